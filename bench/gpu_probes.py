"""GPU probe cost, sustained launch rate and agent CPU on the stand-in libcuda (no GPU).

Runs P copies of the sample workload (samples/gpu/workload.c: per step and thread an
H2D copy, K kernel launches, a memset, a D2H copy and a stream sync or query), each
with T threads and zero modelled GPU time, untraced and traced by one `tokentrace run`
in alternating rounds, and reports:

- probe cost: ns added per probed call (charged to the traced process: uprobe + BPF);
- sustained launches/s and probed calls/s while traced, and whether every launch was
  counted with nothing lost;
- the agent's CPU (the tokentrace process, as a share of one core) and its cost per
  record (burst) and per launch, and from that the share of one core the agent would
  need at 1M launches/s for this workload shape.

    python bench/gpu_probes.py [--procs P] [--threads T] [--steps N] [--kernels K]
                               [--rounds R] [--burst-min-us US [US ...]] [--kernel-ns NS]
                               [--gpu-sample F [F ...]] [--gpu-sample-period S] [--out FILE]

Each --burst-min-us and --gpu-sample value is measured separately (0 and 1: the
defaults of `tokentrace run`, a record per sync and every launch counted). With
--gpu-sample < 1 the launch counts are estimates and the error against the stand-in's
count is reported, with the traced/untraced wall-time ratio. On a 16-core host, e.g.:
    python bench/gpu_probes.py --procs 8 --threads 1 --steps 20000 --burst-min-us 0 1000
and for sampling an eager loop (2 us kernels, 32 per sync):
    python bench/gpu_probes.py --kernel-ns 2000 --steps 30000 --burst-min-us 1000 \
        --gpu-sample 1 0.1 --out /tmp/sample.json
Writes bench/results/gpu_probes.json (or --out).
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

COUNTED = ("launches", "h2d_calls", "d2h_calls", "memset_calls", "sync_calls", "query_calls")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one(paths: dict, args: argparse.Namespace, burst_min_us: int, sample: float,
        traced: bool, tmp: Path) -> dict:
    """One round: P workloads started together, traced or not."""
    work = []
    for i in range(args.procs):
        counts = tmp / f"counts{i}.json"
        env = dict(os.environ, TT_STANDIN_KERNEL_NS=str(args.kernel_ns),
                   TT_STANDIN_COUNTS=str(counts))
        w = subprocess.Popen([str(paths["workload"]), "--wait", "--steps", str(args.steps),
                              "--kernels", str(args.kernels), "--threads", str(args.threads)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert w.stdout.readline().strip() == "ready"
        work.append((w, counts))
    tracer = None
    summary = tmp / "summary.json"
    if traced:
        pids = [a for w, _ in work for a in ("--pid", str(w.pid))]
        tracer = subprocess.Popen([sys.executable, "-m", "tracer", "run", *pids, "--quiet",
                                   "--summary", str(summary),
                                   "--burst-min-us", str(burst_min_us),
                                   "--gpu-sample", str(sample),
                                   "--gpu-sample-period", str(args.gpu_sample_period)],
                                  stderr=subprocess.PIPE, text=True, cwd=ROOT)
        while "attached" not in tracer.stderr.readline():
            if tracer.poll() is not None:
                raise SystemExit(f"tokentrace run failed: {tracer.stderr.read()}")
        cpu0 = cpu_seconds(tracer.pid)
    t0 = time.perf_counter()
    for w, _ in work:
        w.stdin.write("go\n")
        w.stdin.flush()
    for w, _ in work:
        assert w.stdout.readline().strip() == "done"
    seconds = time.perf_counter() - t0
    truth = {}
    for w, counts in work:
        w.wait()
        truth[w.pid] = json.loads(counts.read_text())
    launches = sum(t["launches"] for t in truth.values())
    calls = sum(t[k] for t in truth.values() for k in COUNTED)
    out = {"traced": traced, "seconds": seconds, "probed_calls": calls, "launches": launches,
           "launches_per_s": launches / seconds, "calls_per_s": calls / seconds}
    if tracer is not None:
        # the agent's CPU over the traffic plus the time it takes to catch up with it
        time.sleep(0.3)
        out["tracer_cpu_s"] = cpu_seconds(tracer.pid) - cpu0
        tracer.send_signal(signal.SIGINT)
        tracer.communicate(timeout=120)
        doc = json.loads(summary.read_text())
        seen = {p["pid"]: p for p in doc["gpu"]["processes"]}
        out["bursts"] = sum(p["bursts"] for p in seen.values())
        # an estimate when sampled (summary marks it), else the exact count
        out["launches_reported"] = sum(p["kernel_launches"] for p in seen.values())
        out["launch_count_error"] = (out["launches_reported"] - launches) / launches
        out["lost"] = {k: v for k, v in doc["report"].items()
                       if k.startswith("capture.") and v and k not in (
                           "capture.gpu_attach_errors", "capture.ring_bytes",
                           "capture.ring_fill_peak_bytes")
                       and not k.startswith("capture.probe_cpu_")}  # the overhead meter's
        out["exact"] = sample < 1.0 or all(
            seen.get(pid, {}).get("kernel_launches") == t["launches"] for pid, t in truth.items())
    return out


def summarise(runs: list[dict], burst_min_us: int, sample: float, workers: int) -> dict:
    """Totals over the rounds of one configuration; ``workers`` threads ran at once."""
    bare = [x for x in runs if not x["traced"]]
    tr = [x for x in runs if x["traced"]]
    secs = sum(x["seconds"] for x in tr)
    cpu = sum(x["tracer_cpu_s"] for x in tr)
    launches = sum(x["launches"] for x in tr)
    bursts = sum(x["bursts"] for x in tr)
    # per call within one thread: the threads ran side by side
    ns_bare = (sum(x["seconds"] for x in bare) * workers
               / sum(x["probed_calls"] for x in bare) * 1e9)
    ns_traced = secs * workers / sum(x["probed_calls"] for x in tr) * 1e9
    return {
        "burst_min_us": burst_min_us,
        "gpu_sample": sample,
        # wall time of the same work traced / untraced
        "overhead_ratio": (secs / len(tr)) / (sum(x["seconds"] for x in bare) / len(bare)),
        "launch_count_error": max((x["launch_count_error"] for x in tr), key=abs),
        "ns_per_call_untraced": ns_bare, "ns_per_call_traced": ns_traced,
        "probe_cost_ns": ns_traced - ns_bare,
        "untraced_launches_per_s": sum(x["launches"] for x in bare)
        / sum(x["seconds"] for x in bare),
        "traced_launches_per_s": launches / secs,
        "traced_calls_per_s": sum(x["probed_calls"] for x in tr) / secs,
        "all_exact_no_loss": all(x["exact"] and not x["lost"] for x in tr),
        "agent_cpu_share_of_one_core": cpu / secs,
        "bursts_per_s": bursts / secs,
        "launches_per_burst": launches / bursts if bursts else None,
        "agent_us_per_burst": cpu / bursts * 1e6 if bursts else None,
        "agent_ns_per_launch": cpu / launches * 1e9,
        # the agent's work is per record, and records per launch are this workload's
        "projected_agent_share_at_1M_launches_per_s": cpu / launches * 1e6,
        "runs": runs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=1, help="workload processes (default 1)")
    ap.add_argument("--threads", type=int, default=1, help="threads per process (default 1)")
    ap.add_argument("--steps", type=int, default=3000, help="steps per thread (default 3000)")
    ap.add_argument("--kernels", type=int, default=32,
                    help="launches (distinct kernels) per step and sync (default 32)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--burst-min-us", type=int, nargs="+", default=[0, 1000],
                    help="values passed to tokentrace run, each measured (default: 0 1000)")
    ap.add_argument("--kernel-ns", type=int, default=0,
                    help="modelled GPU time per launch, slept at each sync (default 0)")
    ap.add_argument("--gpu-sample", type=float, nargs="+", default=[1.0],
                    help="values passed to tokentrace run, each measured (default: 1)")
    ap.add_argument("--gpu-sample-period", type=float, default=1.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_probes.json"))
    args = ap.parse_args()
    configs = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        paths = build(tmp / "gpu")
        print(f"built the stand-ins in {tmp / 'gpu'}", file=sys.stderr, flush=True)
        for sample in args.gpu_sample:
            for burst_min_us in args.burst_min_us:
                runs = []
                for r in range(args.rounds):
                    for traced in ((False, True) if r % 2 == 0 else (True, False)):
                        t0 = time.perf_counter()
                        runs.append(one(paths, args, burst_min_us, sample, traced, tmp))
                        print(f"round {r} burst_min_us={burst_min_us} sample={sample} "
                              f"traced={traced}: {runs[-1]['launches_per_s']:,.0f} "
                              f"launches/s, {time.perf_counter() - t0:.1f} s",
                              file=sys.stderr, flush=True)
                configs.append(summarise(runs, burst_min_us, sample,
                                         args.procs * args.threads))
    res = {
        "benchmark": "stand-in libcuda, sample workload, zero modelled GPU time",
        "command": "python bench/gpu_probes.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "kernel": os.uname().release},
        "procs": args.procs, "threads_per_proc": args.threads, "steps": args.steps,
        "kernels_per_step": args.kernels, "kernel_ns": args.kernel_ns, "configs": configs,
    }
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({**res, "configs": [{k: v for k, v in c.items() if k != "runs"}
                                         for c in configs]}, indent=1))


if __name__ == "__main__":
    main()
