"""What the kernel charges a syscall for the way a probe is attached, apart from what
the probe's own program does.

    python bench/attach_cost.py [--calls 200000] [--rounds 8] [--out bench/results/attach_cost.json]

The census (``tokentrace ctl SOCK probe-stats``) times the BPF programs only. A syscall
tracepoint attached as BCC attaches it (a perf event: ``TRACEPOINT_PROBE``) also puts
every syscall of every task on the kernel's slow path while attached, and each hit goes
through perf's syscall handler (a perf buffer, the arguments copied) before the
program runs. This measures, in a child's own CPU time (``os.times``) per ``write(2)``
of one byte to /dev/null, and per ``getppid(2)`` (a syscall no probe wants, which pays
only for what the mode does to every syscall), each way of running a program that does
nothing but return at both the write's entry and its exit:

- ``none``: nothing attached;
- ``tracepoint``: ``syscalls:sys_enter_write`` and ``sys_exit_write`` (how
  bpf/sockets.c attaches today);
- ``raw_tracepoint``: ``raw_syscalls:sys_enter``/``sys_exit`` (every syscall, the
  program returns unless it is a write);
- ``fentry``: fentry/fexit on the write syscall's kernel function (a BPF trampoline;
  no syscall slow path).

Rounds rotate the modes' order; each mode's cost over ``none`` with a 95% interval
over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.real_server import mean_half_width  # noqa: E402

PROGRAMS = {
    "tracepoint": """
TRACEPOINT_PROBE(syscalls, sys_enter_write) { return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_write) { return 0; }
""",
    "raw_tracepoint": """
RAW_TRACEPOINT_PROBE(sys_enter) { return ctx->args[1] == 1 ? 0 : 0; }
RAW_TRACEPOINT_PROBE(sys_exit) { return 0; }
""",
    "fentry": """
KFUNC_PROBE(__x64_sys_write) { return 0; }
KRETFUNC_PROBE(__x64_sys_write) { return 0; }
""",
}


def syscall_cpu_ns(calls: int, which: str) -> float:
    """CPU ns per ``which`` syscall (write: one byte to /dev/null; getppid), in a child
    of its own."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        fd = os.open("/dev/null", os.O_WRONLY)
        b = b"x"
        t0 = os.times()
        if which == "write":
            for _ in range(calls):
                os.write(fd, b)
        else:
            for _ in range(calls):
                os.getppid()
        t1 = os.times()
        cpu = (t1.user - t0.user) + (t1.system - t0.system)
        os.write(w, repr(cpu).encode())
        os._exit(0)
    os.close(w)
    data = os.read(r, 100)
    os.waitpid(pid, 0)
    os.close(r)
    return float(data) * 1e9 / calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "attach_cost.json")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be at least 2: the interval is over rounds")
    from tracer.probes.loader import import_bcc
    bcc = import_bcc()
    loaded, errors = {}, {}
    for name, text in PROGRAMS.items():
        try:
            b = bcc.BPF(text=text.encode())
            b.cleanup()  # compiled and attached once: it works here
            loaded[name] = text
        except Exception as e:  # BCC raises bare Exception
            errors[name] = str(e).splitlines()[0][:200]
    modes = ["none", *loaded]
    calls = ("write", "getppid")
    per: dict[tuple[str, str], list[float]] = {(m, c): [] for m in modes for c in calls}
    for i in range(args.rounds):
        order = modes[i % len(modes):] + modes[:i % len(modes)]
        for m in order:
            b = bcc.BPF(text=loaded[m].encode()) if m != "none" else None
            time.sleep(0.2)
            for c in calls:
                per[m, c].append(syscall_cpu_ns(args.calls, c))
            if b is not None:
                b.cleanup()
        print(f"round {i + 1}: " + ", ".join(f"{m} {per[m, 'write'][-1]:.0f}/"
                                             f"{per[m, 'getppid'][-1]:.0f}" for m in modes),
              file=sys.stderr, flush=True)
    out: dict = {"kernel": platform.release(), "calls": args.calls, "rounds": args.rounds,
                 "not_loaded": errors, "ns_per_call": {}, "added_ns": {}}
    for c in calls:
        out["ns_per_call"][c] = {m: round(statistics.median(per[m, c]), 1) for m in modes}
        out["added_ns"][c] = {}
        for m in modes[1:]:
            mean, half = mean_half_width([a - b for a, b in zip(per[m, c], per["none", c])])
            assert half is not None  # --rounds >= 2
            out["added_ns"][c][m] = {"mean": round(mean, 1),
                                     "ci95": [round(mean - half, 1), round(mean + half, 1)]}
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
