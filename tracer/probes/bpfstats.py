"""What each loaded BPF program costs: the kernel's run count and run time per program.

The kernel counts a program's runs and the nanoseconds spent in it only while run-time
statistics are on (a static key: two clock reads per run). ``BPF_ENABLE_STATS`` turns
them on for as long as the returned descriptor stays open, so closing it (or the agent
exiting) turns them off again; no sysctl is left changed. The counts are read from the
program descriptor's ``/proc/self/fdinfo`` entry (``run_cnt``, ``run_time_ns``).

Apart from those statistics, the kernel counts the runs it skipped
(``recursion_misses``, Linux 6.7 for tracepoints): a tracepoint's program is not run
while another BPF program, of any tool, runs on that CPU, and a softirq landing in
one (a delayed-ACK timer, packets) runs its tracepoints unseen. ``missed_runs``
reads them, always on.

The run time is the program's own: a uprobe's trap and single-step, or a tracepoint's
entry into BPF, are not in it. Runs are hits, so hits times a per-hit trap cost measured
on the same host (``bench/gpu_probes.py``) gives the rest.
"""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass
from typing import Any, Callable, Mapping

BPF_ENABLE_STATS = 32  # enum bpf_cmd (include/uapi/linux/bpf.h)
BPF_STATS_RUN_TIME = 0  # enum bpf_stats_type
_SYS_BPF = {"x86_64": 321, "aarch64": 280}


@dataclass(frozen=True)
class ProgramCost:
    """One program's runs and the nanoseconds spent in it since statistics went on."""

    runs: int
    run_ns: int


# What one run costs beyond the program's own run time, by how the program is entered.
# A syscall tracepoint: a do-nothing program at a write's entry and exit added 311 ns
# (227-396) to the write on the 2-vCPU VM, 84 ns (35-133) of it the syscall slow path
# that every syscall takes once any syscall tracepoint is attached, so ~115 ns a run
# (bench/attach_cost.py, bench/results/attach_cost.json). A uprobe: a probed call cost
# 1,137 ns more on an H100 host and 766 ns on an H200 (bench/gpu_probes.py,
# gpu_probes-h{100,200}-1proc.json), of which the launch program's own run is ~370 ns
# (the H200 census): the H100's trap, ~750 ns, is taken for all.
HIT_NS = {"tracepoint": 115, "uprobe": 750}


def hit_kind(program: str) -> str:
    """How the kernel enters ``program``: BCC names tracepoint programs
    ``tracepoint__CATEGORY__EVENT``; the agent's other hooks are uprobes."""
    return "tracepoint" if program.startswith("tracepoint__") else "uprobe"


@dataclass(frozen=True)
class ProbeTime:
    """The programs' own run time over a stretch, and their runs by how each was
    entered; ``total_ns`` adds each run's entry (``HIT_NS``).

    ``traced_tracepoint_runs``: of the tracepoint runs, those for traced processes,
    as the probes count them (the kernel counter ``traced_tp_runs``: their syscalls
    and their connections' TCP events; None where not counted). The rest,
    ``others_runs``, stopped at the pid or port filter in processes nobody traces and
    cost those processes, not the traced ones: ``traced_ns`` leaves them out. The
    uprobes are attached to the traced processes alone."""

    program_ns: int
    hits: dict[str, int]
    traced_tracepoint_runs: int | None = None

    @property
    def entry_ns(self) -> int:
        """Every run's entry (``HIT_NS``), in every process."""
        return sum(HIT_NS[k] * n for k, n in self.hits.items())

    @property
    def total_ns(self) -> int:
        """Every run's time and entry, in every process."""
        return self.program_ns + self.entry_ns

    @property
    def others_runs(self) -> int:
        """Tracepoint runs not for traced processes (0 where not counted)."""
        if self.traced_tracepoint_runs is None:
            return 0
        return max(0, self.hits.get("tracepoint", 0) - self.traced_tracepoint_runs)

    def traced_ns(self, early_exit_ns: int) -> int:
        """The traced processes' part of ``total_ns``: less the other processes' runs,
        each its entry and an early exit of ``early_exit_ns`` (``early_exit_ns``
        measures it on the host). Their program time is taken off at most down to
        none: the traced runs keep their entries whatever the early exits cost."""
        others = self.others_runs
        entries = self.entry_ns - HIT_NS["tracepoint"] * others
        return max(0, entries) + max(0, self.program_ns - others * early_exit_ns)

    def __add__(self, other: "ProbeTime") -> "ProbeTime":
        hits = dict(self.hits)
        for k, n in other.hits.items():
            hits[k] = hits.get(k, 0) + n
        a, b = self.traced_tracepoint_runs, other.traced_tracepoint_runs
        return ProbeTime(self.program_ns + other.program_ns, hits,
                         None if a is None or b is None else a + b)


def probe_time(before: dict[str, ProgramCost], after: dict[str, ProgramCost],
               traced_tracepoint_runs: int | None = None) -> ProbeTime:
    """What the programs spent between two ``ProgramStats.read``s (a program loaded
    in between counts from zero; one gone, not at all). ``traced_tracepoint_runs``:
    how many of the tracepoint runs in between were for traced processes."""
    ns, hits = 0, {}
    for name, cost in after.items():
        was = before.get(name, ProgramCost(0, 0))
        runs = max(0, cost.runs - was.runs)
        ns += max(0, cost.run_ns - was.run_ns)
        if runs:
            kind = hit_kind(name)
            hits[kind] = hits.get(kind, 0) + runs
    return ProbeTime(ns, hits, traced_tracepoint_runs)


EARLY_EXIT_PROGRAMS = ("tracepoint__syscalls__sys_enter_write",
                       "tracepoint__syscalls__sys_exit_write")


def early_exit_ns(programs: Callable[[], Mapping[str, ProgramCost]], calls: int = 4000,
                  tries: int = 3) -> int | None:
    """What a syscall tracepoint's program costs a process nobody traces, on this host:
    the caller (the agent, never traced) writes a byte to /dev/null ``calls`` times
    between two reads of the write probes' counts, with the statistics on. Other
    processes' writes in those milliseconds run too, a traced one's at many times the
    cost, so the least of ``tries`` is taken. None where the write probes are not
    loaded or did not run."""
    best: float | None = None
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        for _ in range(tries):
            before = programs()
            if not all(p in before for p in EARLY_EXIT_PROGRAMS):
                return None
            for _ in range(calls):
                os.write(fd, b"\0")
            after = programs()
            runs = sum(after[p].runs - before[p].runs for p in EARLY_EXIT_PROGRAMS if p in after)
            ns = sum(after[p].run_ns - before[p].run_ns for p in EARLY_EXIT_PROGRAMS if p in after)
            if runs >= calls:  # the kernel counted our runs: statistics on, probes in
                best = ns / runs if best is None else min(best, ns / runs)
    finally:
        os.close(fd)
    return None if best is None else round(best)


class ProgramStats:
    """Run-time statistics for the agent's programs, on while ``enable`` holds them."""

    def __init__(self) -> None:
        self._fd: int | None = None

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def enable(self) -> None:
        """Turn run-time statistics on (for every BPF program on the host, which is how
        the kernel keeps them) until ``disable``. Raises ``OSError`` with the reason."""
        if self._fd is not None:
            return
        nr = _SYS_BPF.get(platform.machine())
        if nr is None:
            raise OSError(f"probe statistics: no bpf syscall number for {platform.machine()}")
        libc = ctypes.CDLL(None, use_errno=True)
        attr = (ctypes.c_uint32 * 2)(BPF_STATS_RUN_TIME, 0)  # union bpf_attr.enable_stats
        fd = libc.syscall(nr, BPF_ENABLE_STATS, ctypes.byref(attr), ctypes.sizeof(attr))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"probe statistics: BPF_ENABLE_STATS: {os.strerror(err)} "
                               "(needs Linux 5.8 and CAP_SYS_ADMIN)")
        self._fd = fd

    def disable(self) -> None:
        """Turn them off again (unless another process holds them on too)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @staticmethod
    def read(funcs: dict[Any, Any]) -> dict[str, ProgramCost]:
        """Run count and run time of each program in ``funcs`` (BCC's ``BPF.funcs``:
        name -> an object with ``fd``). A program whose entry cannot be read, or that
        has no counts (statistics never on), is left out."""
        out: dict[str, ProgramCost] = {}
        for name, fn in funcs.items():
            fields = fdinfo(fn.fd)
            if "run_cnt" in fields and "run_time_ns" in fields:
                key = name.decode() if isinstance(name, bytes) else str(name)
                out[key] = ProgramCost(int(fields["run_cnt"]), int(fields["run_time_ns"]))
        return out


STATS_SYSCTL = "/proc/sys/kernel/bpf_stats_enabled"


def stats_sysctl_on(path: str = STATS_SYSCTL) -> bool:
    """Whether the node keeps run-time statistics on for every program (the sysctl
    ``kernel.bpf_stats_enabled=1``): then they can be read without ``BPF_ENABLE_STATS``,
    which takes CAP_SYS_ADMIN."""
    try:
        with open(path) as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def missed_runs(funcs: dict[Any, Any]) -> dict[str, int]:
    """Runs the kernel skipped, per program of ``funcs`` that had any (``name`` without
    BCC's ``tracepoint__`` prefix, ``category:event``); empty where the kernel does
    not count them."""
    out: dict[str, int] = {}
    for name, fn in funcs.items():
        n = int(fdinfo(fn.fd).get("recursion_misses", "0") or 0)
        if n:
            key = name.decode() if isinstance(name, bytes) else str(name)
            key = key.removeprefix("tracepoint__").replace("__", ":", 1)
            out[key] = n
    return out


def fdinfo(fd: int | str, pid: int | str = "self") -> dict[str, str]:
    """The ``key: value`` lines of ``/proc/PID/fdinfo/FD`` (this process's by default)."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}") as f:
            text = f.read()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def format_costs(costs: dict[str, ProgramCost]) -> str:
    """``name=runs/ns`` for each program that ran, busiest first (the ctl answer)."""
    ran = sorted(((c.run_ns, c.runs, n) for n, c in costs.items() if c.runs), reverse=True)
    return " ".join(f"{n}={runs}/{ns}" for ns, runs, n in ran)


def parse_costs(text: str) -> dict[str, ProgramCost]:
    """The inverse of ``format_costs`` (words that are not ``name=runs/ns`` are skipped)."""
    out: dict[str, ProgramCost] = {}
    for word in text.split():
        name, sep, val = word.partition("=")
        runs, sep2, ns = val.partition("/")
        if sep and sep2 and runs.isdigit() and ns.isdigit():
            out[name] = ProgramCost(int(runs), int(ns))
    return out
