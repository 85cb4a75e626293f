"""What a syscall tracepoint costs the processes it does not trace, and how many
syscalls a server makes: a diagnostic for bench/real_server.py, held by the bench, not
the agent.

While any syscall tracepoint is attached the kernel sends every syscall of every task
through its slow path (``SYSCALL_WORK_SYSCALL_TRACEPOINT`` is set on all of them), so
the socket probes tax syscalls they never look at: a GPU server's futex, ioctl and
sched_yield calls. ``SyscallWatch.slow_path`` attaches a program that does nothing to a
syscall the server does not make (getppid): the cost of that slow path alone, with no
probe of ours running. ``SyscallWatch.count`` counts a process tree's syscalls by
number (on ``raw_syscalls:sys_enter``: itself a syscall tracepoint, so only where the
slow path is on anyway).

    watch = SyscallWatch()
    watch.slow_path(True); ...; watch.slow_path(False)
    watch.count_start({pid, ...}); ...; rates = watch.count_stop()  # {"futex": n, ...}
"""

from __future__ import annotations

from typing import Any

PROGRAM = r"""
BPF_HASH(watched, u32, u8, 1024);            // tgids whose syscalls are counted
BPF_PERCPU_ARRAY(calls, u64, 512);           // syscall number -> calls

// nothing: attached, it only turns the kernel's syscall slow path on
int tt_noop(void *ctx) { return 0; }

TRACEPOINT_PROBE(raw_syscalls, sys_enter)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!watched.lookup(&tgid))
        return 0;
    u32 nr = args->id;
    u64 *n = calls.lookup(&nr);   // bounded by the array: numbers past 511 are dropped
    if (n)
        *n += 1;
    return 0;
}
"""

NOOP_TRACEPOINT = "syscalls:sys_enter_getppid"
COUNT_TRACEPOINT = "raw_syscalls:sys_enter"


class SyscallWatch:
    """The bench's own BPF object: the slow-path switch and the syscall counter."""

    def __init__(self) -> None:
        from bcc import BPF
        self.bpf = BPF(text=PROGRAM)
        # TRACEPOINT_PROBE attaches at load: the counter waits detached until asked
        self.bpf.detach_tracepoint(tp=COUNT_TRACEPOINT)
        self.noop_on = False
        self.counting = False

    def slow_path(self, on: bool) -> None:
        """Attach (detach) the do-nothing syscall tracepoint."""
        if on and not self.noop_on:
            self.bpf.attach_tracepoint(tp=NOOP_TRACEPOINT, fn_name=b"tt_noop")
        elif not on and self.noop_on:
            self.bpf.detach_tracepoint(tp=NOOP_TRACEPOINT)
        self.noop_on = on

    def count_start(self, tgids: set[int]) -> None:
        """Count the syscalls of these processes from now."""
        from ctypes import c_uint8, c_uint32
        watched = self.bpf["watched"]
        watched.clear()
        for t in tgids:
            watched[c_uint32(t)] = c_uint8(1)
        self.bpf["calls"].clear()
        if not self.counting:
            self.bpf.attach_tracepoint(tp=COUNT_TRACEPOINT,
                                       fn_name=b"tracepoint__raw_syscalls__sys_enter")
            self.counting = True

    def count_stop(self) -> dict[str, int]:
        """Detach the counter; the calls it saw, by syscall name, most first."""
        from bcc.syscall import syscall_name
        if self.counting:
            self.bpf.detach_tracepoint(tp=COUNT_TRACEPOINT)
            self.counting = False
        out: dict[str, int] = {}
        for k, v in self.bpf["calls"].items():
            n = sum(v)
            if n:
                out[syscall_name(k.value).decode()] = n
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def close(self) -> None:
        self.slow_path(False)
        if self.counting:
            self.count_stop()
        self.bpf.cleanup()


def rates(counts: list[dict[str, int]], seconds: float) -> dict[str, Any]:
    """Several slices' counts as calls per second, by name, and their total."""
    total: dict[str, int] = {}
    for c in counts:
        for name, n in c.items():
            total[name] = total.get(name, 0) + n
    per_s = {name: round(n / seconds, 1) for name, n in
             sorted(total.items(), key=lambda kv: -kv[1])} if seconds > 0 else {}
    return {"seconds": round(seconds, 2), "all_per_s": round(sum(total.values()) / seconds, 1)
            if seconds > 0 else None, "per_s": per_s}
