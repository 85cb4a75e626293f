"""What a uprobe's trap costs the Python code around it, beyond its own system time.

HF serve CB loses ~3% of its tokens/s traced, but the probes' system CPU explains only
half of it: the rest is the server's user time, +~30 us a token. One candidate is what
each trap leaves behind for the interpreter (caches, TLB, branch predictors, the CPU's
mitigations on every kernel entry): it would show as user time that grows with the
traps, not as system time. This bench measures it alone, with no agent and no server.

A Python worker (pinned to one CPU; ``--workers`` of them on CPUs of their own) loops:
interpreter work over a working set of objects (``--work-objs`` per iteration out of
``--set-objs``), then ``--calls`` calls through ctypes to each of two C functions in a
shared library built here. The bench attaches a uprobe to one of them (a BPF program
doing what a GPU probe's does at least: a hash look-up of the process and a per-CPU
counter), or nothing, in alternating slices (U T T U ...), and reads the workers'
iterations, their user and system CPU (``/proc/PID/stat``) and their CPU time
(``schedstat``) per slice. Per probed call it reports, traced minus untraced with 95%
intervals over the pairs: wall time, CPU time, system time and user time. If the trap
costs only its own kernel time, user time per call does not move and wall time ~=
system time. Modes: ``uprobe`` (a function whose first instruction is a push, which the
kernel emulates: libcuda's entry points begin so), ``uprobe-xol`` (one it must
single-step out of line) and ``uretprobe`` (entry and return).

    python bench/trap_aftereffect.py [--slices 60] [--slice-s 1] [--settle-s 0.1]
        [--calls 1] [--work-objs 400] [--set-objs 20000] [--workers 1] [--cpu N]
        [--modes uprobe,uprobe-xol,uretprobe] [--lib SO] [--out FILE]

Writes bench/results/trap_aftereffect.json (or --out).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import mmap
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from real_server import cpu_times, mean_half_width, tree_threads  # noqa: E402

# Two targets: one whose first instruction is a push, which the kernel emulates at the
# trap, and one whose first instruction it must single-step out of line (a second trap)
LIB_C = r"""
__attribute__((noinline)) long tt_push(long x) { __asm__ volatile("" ::: "rbx"); return x * 3 + 1; }
__attribute__((noinline)) long tt_step(long x) { return x * 3 + 1; }
"""
TARGET = {"uprobe": b"tt_push", "uretprobe": b"tt_push", "uprobe-xol": b"tt_step"}

PROGRAM = r"""
BPF_HASH(traced, u32, u8, 64);
BPF_PERCPU_ARRAY(hits, u64, 1);

int tt_probe(struct pt_regs *ctx)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!traced.lookup(&tgid))
        return 0;
    u32 zero = 0;
    u64 *n = hits.lookup(&zero);
    if (n)
        *n += 1;
    return 0;
}
"""

WORKER = r"""
import ctypes, mmap, os, sys, types
lib = ctypes.CDLL(sys.argv[1])
push, step = lib.tt_push, lib.tt_step
for f in (push, step):
    f.argtypes = [ctypes.c_long]
    f.restype = ctypes.c_long
calls, work_objs, set_objs = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
objs = [types.SimpleNamespace(a=i, b=str(i), c={"k": i, "v": [i]}) for i in range(set_objs)]
fd = os.open(sys.argv[2], os.O_RDWR)
counter = mmap.mmap(fd, 8)
view = memoryview(counter).cast("Q")
k = 0
n = 0
while True:
    s = 0
    for o in objs[k:k + work_objs]:
        s += o.a + len(o.b) + o.c["k"] + o.c["v"][0]
    k = (k + work_objs) % (set_objs - work_objs)
    for _ in range(calls):
        s = step(push(s & 0xffff) & 0xffff)
    n += 1
    view[0] = n
"""


def run_ns(pid: int) -> int:
    """The process's CPU time so far, in ns (the scheduler's, not ticks)."""
    return sum(int(Path(f"{task}/schedstat").read_text().split()[0])
               for task in tree_threads(pid))


def mean_ci(xs: list[float]) -> dict[str, float]:
    """Mean of ``xs`` and its 95% t-interval."""
    m, h = mean_half_width(xs)
    if h is None:
        return {"mean": m, "lo": math.nan, "hi": math.nan}
    return {"mean": m, "lo": m - h, "hi": m + h}


class Probe:
    """The bench's uprobe on one of the targets, attached or not."""

    def __init__(self, lib: str, pids: set[int]) -> None:
        from bcc import BPF
        self.bpf = BPF(text=PROGRAM)
        for pid in pids:
            self.bpf[b"traced"][ctypes.c_uint32(pid)] = ctypes.c_uint8(1)
        self.lib = lib
        self.on: str | None = None

    def set(self, mode: str | None) -> None:
        if self.on == mode:
            return
        lib = self.lib.encode()
        if self.on is not None:
            self.bpf.detach_uprobe(name=lib, sym=TARGET[self.on])
            if self.on == "uretprobe":
                self.bpf.detach_uretprobe(name=lib, sym=TARGET[self.on])
        if mode is not None:
            self.bpf.attach_uprobe(name=lib, sym=TARGET[mode], fn_name=b"tt_probe")
            if mode == "uretprobe":
                self.bpf.attach_uretprobe(name=lib, sym=TARGET[mode], fn_name=b"tt_probe")
        self.on = mode

    def hits(self) -> int:
        return int(sum(self.bpf[b"hits"][ctypes.c_int(0)]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slices", type=int, default=60, help="slices per mode pair set")
    ap.add_argument("--slice-s", type=float, default=1.0)
    ap.add_argument("--calls", type=int, default=1,
                    help="calls of each target per iteration")
    ap.add_argument("--work-objs", type=int, default=400, help="objects per iteration")
    ap.add_argument("--set-objs", type=int, default=20000, help="the working set")
    ap.add_argument("--modes", default="uprobe,uprobe-xol",
                    help="of uprobe (on a push), uprobe-xol (stepped out of line), "
                         "uretprobe (entry and return)")
    ap.add_argument("--lib", metavar="SO", help="the targets built already (LIB_C, as "
                    "cc -O2 -fPIC -shared builds it), for a host without a compiler")
    ap.add_argument("--workers", type=int, default=1,
                    help="workers, each on a CPU of its own (down from --cpu)")
    ap.add_argument("--settle-s", type=float, default=0.1, help="wait after each switch")
    ap.add_argument("--cpu", type=int, default=-1,
                    help="the first worker's CPU (default: the last CPU)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/trap_aftereffect.json"))
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in TARGET]:
        ap.error(f"unknown mode(s) {', '.join(bad)}: of {', '.join(TARGET)}")
    cpu = args.cpu if args.cpu >= 0 else os.cpu_count() - 1

    with tempfile.TemporaryDirectory() as tmp:
        lib = Path(args.lib).resolve() if args.lib else Path(tmp) / "libtttarget.so"
        if not args.lib:
            (Path(tmp) / "t.c").write_text(LIB_C)
            subprocess.run(["cc", "-O2", "-fPIC", "-shared", "-o", str(lib),
                            str(Path(tmp) / "t.c")], check=True)
        cpus = [c % (os.cpu_count() or 1) for c in range(cpu, cpu - args.workers, -1)]
        workers, views = [], []
        for i, c in enumerate(cpus):
            cfile = Path(tmp) / f"count{i}"
            cfile.write_bytes(b"\0" * 8)
            workers.append(subprocess.Popen(
                ["taskset", "-c", str(c), sys.executable, "-c", WORKER, str(lib), str(cfile),
                 str(args.calls), str(args.work_objs), str(args.set_objs)]))
            fd = os.open(cfile, os.O_RDONLY)
            views.append(memoryview(mmap.mmap(fd, 8, prot=mmap.PROT_READ)).cast("Q"))
            os.close(fd)

        def sample() -> tuple[int, float, float, float]:
            times = [cpu_times(w.pid) for w in workers]
            return (sum(v[0] for v in views), sum(u for u, _ in times),
                    sum(s for _, s in times), sum(run_ns(w.pid) for w in workers) / 1e9)
        try:
            time.sleep(2.0)  # imports, the working sets built
            probe = Probe(str(lib), {w.pid for w in workers})
            order: list[tuple[int, str | None]] = []  # (pair, mode)
            for r in range(args.slices):
                for m in modes:
                    pair = len(order) // 2
                    order += [(pair, None), (pair, m)] if r % 2 == 0 else [(pair, m), (pair, None)]
            slices = []
            for pair, mode in order:
                probe.set(mode)
                time.sleep(args.settle_s)  # the switch's own work out of the slice
                h0, (n0, u0, s0, c0), t0 = probe.hits(), sample(), time.perf_counter()
                time.sleep(args.slice_s)
                h1, (n1, u1, s1, c1), t1 = probe.hits(), sample(), time.perf_counter()
                slices.append({"pair": pair, "mode": mode or "off", "of": order[2 * pair][1]
                               or order[2 * pair + 1][1], "iters": n1 - n0, "wall_s": t1 - t0,
                               "user_s": u1 - u0, "sys_s": s1 - s0, "cpu_s": c1 - c0,
                               "hits": h1 - h0})
            probe.set(None)
        finally:
            for w in workers:
                w.kill()
                w.wait()

    result = {"host": platform.node(), "kernel": platform.release(),
              "cpu": _cpu_model(), "args": vars(args), "modes": {}}
    for m in modes:
        per_call = {"wall_us": [], "cpu_us": [], "sys_us": [], "user_us": [], "rate_log": []}
        hits = []
        ms = [s for s in slices if s["of"] == m]
        for a, b in zip(ms[0::2], ms[1::2]):
            u, t = (a, b) if a["mode"] == "off" else (b, a)
            if not u["iters"] or not t["iters"]:
                continue
            c, W = args.calls, args.workers  # wall per iteration is per worker
            per_call["wall_us"].append(1e6 * W * (t["wall_s"] / t["iters"]
                                                  - u["wall_s"] / u["iters"]) / c)
            per_call["cpu_us"].append(1e6 * (t["cpu_s"] / t["iters"] - u["cpu_s"] / u["iters"]) / c)
            per_call["sys_us"].append(1e6 * (t["sys_s"] / t["iters"] - u["sys_s"] / u["iters"]) / c)
            per_call["user_us"].append(1e6 * (t["user_s"] / t["iters"]
                                              - u["user_s"] / u["iters"]) / c)
            per_call["rate_log"].append(math.log((t["iters"] / t["wall_s"])
                                                 / (u["iters"] / u["wall_s"])))
            hits.append(t["hits"] / (t["iters"] * c))
        untraced = [s for s in ms if s["mode"] == "off"]
        iter_us = 1e6 * args.workers * sum(s["wall_s"] for s in untraced) \
            / sum(s["iters"] for s in untraced)
        r = {k: mean_ci(v) for k, v in per_call.items() if k != "rate_log"}
        lr = mean_ci(per_call["rate_log"])
        r["rate_ratio"] = {k: math.exp(v) for k, v in lr.items()}
        r["pairs"] = len(hits)
        r["hits_per_call"] = statistics.fmean(hits) if hits else 0.0
        r["untraced_iteration_us"] = iter_us
        r["calls_per_s_untraced"] = args.calls * 1e6 / iter_us
        result["modes"][m] = r
        w, s_, u_, c_ = r["wall_us"], r["sys_us"], r["user_us"], r["cpu_us"]
        print(f"{m}: {r['pairs']} pairs, iteration {iter_us:.1f} us untraced; per call: "
              f"wall +{w['mean']:.2f} us ({w['lo']:.2f} to {w['hi']:.2f}), "
              f"CPU +{c_['mean']:.2f} ({c_['lo']:.2f} to {c_['hi']:.2f}), "
              f"system +{s_['mean']:.2f} ({s_['lo']:.2f} to {s_['hi']:.2f}), "
              f"user +{u_['mean']:.2f} ({u_['lo']:.2f} to {u_['hi']:.2f}); "
              f"rate {r['rate_ratio']['mean']:.4f} ({r['rate_ratio']['lo']:.4f}-"
              f"{r['rate_ratio']['hi']:.4f}); probe hits/call {r['hits_per_call']:.3f}",
              file=sys.stderr)
    result["slices"] = slices
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


if __name__ == "__main__":
    sys.exit(main())
