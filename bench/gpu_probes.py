"""GPU probe cost and throughput on the stand-in libcuda (no GPU needed).

Runs the sample workload (samples/gpu/workload.c: launches, copies, memsets, syncs) with
zero modelled GPU time, untraced and traced by `tokentrace run` in alternating rounds
of one run, and reports: ns added per probed call, sustained probed calls/s, whether
anything was lost, and the tracer's CPU per second of traced work.

    python bench/gpu_probes.py [--steps N] [--threads T] [--rounds R]

Writes bench/results/gpu_probes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from samples.gpu.build import build  # noqa: E402

KERNELS = 32


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one(paths: dict, steps: int, threads: int, traced: bool, tmp: Path) -> dict:
    counts = tmp / "counts.json"
    env = dict(os.environ, TT_STANDIN_KERNEL_NS="0", TT_STANDIN_COUNTS=str(counts))
    w = subprocess.Popen([str(paths["workload"]), "--wait", "--steps", str(steps), "--kernels",
                          str(KERNELS), "--threads", str(threads)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    assert w.stdout.readline().strip() == "ready"
    tracer = None
    summary = tmp / "summary.json"
    if traced:
        tracer = subprocess.Popen([sys.executable, "-m", "tracer", "run", "--pid", str(w.pid),
                                   "--quiet", "--summary", str(summary)],
                                  stderr=subprocess.PIPE, text=True, cwd=ROOT)
        while "attached" not in tracer.stderr.readline():
            pass
        cpu0 = cpu_seconds(tracer.pid)
    t0 = time.perf_counter()
    w.stdin.write("go\n")
    w.stdin.flush()
    assert w.stdout.readline().strip() == "done"
    seconds = time.perf_counter() - t0
    w.wait()
    truth = json.loads(counts.read_text())
    calls = sum(truth[k] for k in ("launches", "h2d_calls", "d2h_calls", "memset_calls",
                                   "sync_calls", "query_calls"))
    out = {"traced": traced, "seconds": seconds, "probed_calls": calls,
           "launches": truth["launches"], "calls_per_s": calls / seconds}
    if tracer is not None:
        time.sleep(0.2)
        out["tracer_cpu_s"] = cpu_seconds(tracer.pid) - cpu0
        tracer.send_signal(signal.SIGINT)
        _, err = tracer.communicate(timeout=60)
        (proc,) = json.loads(summary.read_text())["gpu"]["processes"]
        out["launches_seen"] = proc["kernel_launches"]
        out["lost"] = json.loads(summary.read_text())["report"].get("capture.lost_gpu")
        out["exact"] = proc["kernel_launches"] == truth["launches"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        paths = build(tmp / "gpu")
        runs = []
        for r in range(args.rounds):
            for traced in ((False, True) if r % 2 == 0 else (True, False)):
                runs.append(one(paths, args.steps, args.threads, traced, tmp))
    bare = [x for x in runs if not x["traced"]]
    tr = [x for x in runs if x["traced"]]
    ns_bare = sum(x["seconds"] for x in bare) / sum(x["probed_calls"] for x in bare) * 1e9
    ns_traced = sum(x["seconds"] for x in tr) / sum(x["probed_calls"] for x in tr) * 1e9
    cpu = sum(x["tracer_cpu_s"] for x in tr) / sum(x["seconds"] for x in tr)
    res = {
        "benchmark": "stand-in libcuda, sample workload, zero modelled GPU time",
        "machine": {"cpus": os.cpu_count(), "kernel": os.uname().release},
        "steps": args.steps, "threads": args.threads, "kernels_per_step": KERNELS,
        "ns_per_call_untraced": ns_bare, "ns_per_call_traced": ns_traced,
        "probe_cost_ns": ns_traced - ns_bare,
        "traced_calls_per_s": sum(x["probed_calls"] for x in tr) / sum(x["seconds"] for x in tr),
        "tracer_cpu_share_of_one_core": cpu,
        "all_exact_no_loss": all(x["exact"] and not x["lost"] for x in tr),
        "runs": runs,
    }
    out = ROOT / "bench" / "results" / "gpu_probes.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
