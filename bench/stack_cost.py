"""What launch-site stack sampling costs the traced process, per GPU call, by rate.

A Python workload at a given Python stack depth (``--depth``, 40 by default: about what
an HF ``transformers serve`` engine thread has under a kernel launch) calls the stand-in
``libcuda.so.1``'s ``cuLaunchKernel`` through ctypes in rounds of ``--calls`` calls and
times each round. One ``tokentrace`` is attached with stack sampling; between rounds
the sampler is switched (bpf/stacks.c reads its settings per call): paused, or sampling
every N-th call on average for each ``--every`` N. Rounds of every setting alternate
(``--rounds`` times), untraced rounds are run before attaching and after detaching, and
the median ns per call of each is reported, with the cost added over "paused" (tracing
without stacks pays only the uprobe and the burst count):

- ``paused``: the launch probe (uprobe + burst) and one array read;
- ``every N``: plus the countdown and new-kernel lookups per call, and a sample (Python
  frames walked, a hash, a slot count; the first sample of a stack also its slice)
  every N calls.

    sudo .venv/bin/python bench/stack_cost.py [--every 1 16 64 256] [--depth 40]
        [--calls 20000] [--rounds 5] [--out bench/results/stack_cost.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKLOAD = r"""
import ctypes, sys, time
cuda = ctypes.CDLL(sys.argv[1])
u = ctypes.c_uint
cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_void_p]
cuda.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
depth, calls = int(sys.argv[2]), int(sys.argv[3])
hs = []
for name in (b"k0", b"k1", b"k2", b"k3"):
    h = ctypes.c_void_p(); cuda.cuModuleGetFunction(ctypes.byref(h), None, name); hs.append(h)
launch, sync = cuda.cuLaunchKernel, cuda.cuStreamSynchronize
def rounds():
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            return
        t0 = time.perf_counter_ns()
        for i in range(calls // 32):
            for j in range(32):
                launch(hs[j & 3], 1, 1, 1, 32, 1, 1, 0, None, None, None)
            sync(None)
        print((time.perf_counter_ns() - t0) / (calls // 32 * 32), flush=True)
def down(n):
    return down(n - 1) if n > 0 else rounds()
down(depth)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--depth", type=int, default=40)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "stack_cost.json"))
    args = ap.parse_args()
    import tempfile

    from samples.gpu.build import build
    from tracer.probes.session import CaptureConfig
    from tracer.runner import TraceRun

    tmp = Path(tempfile.mkdtemp(prefix="tt-stackcost-"))
    lib = build(tmp)["libcuda"]
    w = subprocess.Popen([sys.executable, "-c", WORKLOAD, str(lib), str(args.depth),
                          str(args.calls)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env={"TT_STANDIN_KERNEL_NS": "0"})
    assert w.stdout.readline().strip() == "ready"

    def one() -> float:
        w.stdin.write("go\n")
        w.stdin.flush()
        return float(w.stdout.readline())

    results: dict[str, list[float]] = {"untraced": []}
    for _ in range(args.rounds):
        results["untraced"].append(one())
    run = TraceRun(CaptureConfig(pids=[w.pid], stack_every=1, concerns=("cuda", "process")),
                   [])
    run.start()
    try:
        cfg = run.session.bpf[b"stk_config"]
        settings = ["paused"] + [f"every {n}" for n in args.every]
        for s in settings:
            results[s] = []
        for _ in range(args.rounds):
            for s in settings:
                if s == "paused":
                    run.session.stacks.enable(False)
                else:
                    cfg[ctypes.c_int(0)] = ctypes.c_uint64(int(s.split()[1]))
                    run.session.stacks.enable(True)
                results[s].append(one())
        counters = run.session.stacks.counters()
    finally:
        run.stop()
    after = [one() for _ in range(args.rounds)]
    results["untraced"] += after
    w.stdin.write("quit\n")
    w.stdin.flush()
    w.wait(10)
    med = {k: statistics.median(v) for k, v in results.items()}
    doc = {"depth": args.depth, "calls_per_round": args.calls, "rounds": args.rounds,
           "ns_per_call_median": {k: round(v, 1) for k, v in med.items()},
           "ns_per_call_rounds": {k: [round(x, 1) for x in v] for k, v in results.items()},
           "added_over_paused_ns": {k: round(v - med["paused"], 1) for k, v in med.items()
                                    if k.startswith("every")},
           "probe_ns_paused_over_untraced": round(med["paused"] - med["untraced"], 1),
           "counters": counters,
           "note": "one 2-vCPU VM shared with other work: ratios within one run only"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
