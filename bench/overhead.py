"""Overhead of tracing on the sample OpenAI server: requests/s without and with
`tokentrace run` attached, measured in one run with alternating phases (off, on, off,
on, ...) so that machine drift hits both sides alike. The tracer runs as its own
process exporting JSONL, as in production; the load comes from a third process.

Writes bench/results/overhead.json and prints a table. Needs root.

    .venv/bin/python bench/overhead.py [--rounds 3] [--seconds 10] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from samples.launch import SampleServer  # noqa: E402


def cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def load(port: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "loadgen.py"), "--port", str(port),
           "--concurrency", str(args.concurrency), "--seconds", str(args.seconds)]
    if args.stream:
        cmd.append("--stream")
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def traced_phase(server: SampleServer, args: argparse.Namespace, out: Path) -> dict:
    tracer = subprocess.Popen([sys.executable, "-m", "tracer", "run", "--pid", str(server.pid),
                               "--jsonl", str(out), "--quiet"], stderr=subprocess.PIPE,
                              text=True, cwd=ROOT)
    assert tracer.stderr is not None
    line = tracer.stderr.readline()
    if "attached" not in line:
        raise SystemExit(f"tracer did not attach: {line}{tracer.stderr.read()}")
    cpu0 = cpu_seconds(tracer.pid)
    res = load(server.port, args)
    res["tracer_cpu_s"] = cpu_seconds(tracer.pid) - cpu0
    time.sleep(0.3)
    tracer.send_signal(signal.SIGINT)
    _, err = tracer.communicate(timeout=120)
    res["tracer_report"] = err.strip().splitlines()[-1]
    res["spans"] = sum(1 for _ in out.open())
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--stream", action="store_true", default=True)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "overhead.json"))
    args = p.parse_args()
    phases: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, SampleServer(port=18931) as server:
        load(server.port, argparse.Namespace(**{**vars(args), "seconds": 2}))  # warm up
        for r in range(args.rounds):
            off = load(server.port, args)
            off.update(mode="untraced", round=r)
            phases.append(off)
            on = traced_phase(server, args, Path(tmp) / f"spans{r}.jsonl")
            on.update(mode="traced", round=r)
            phases.append(on)
            print(f"round {r}: untraced {off['rps']:.1f} req/s, traced {on['rps']:.1f} req/s, "
                  f"tracer CPU {on['tracer_cpu_s'] / on['seconds'] * 100:.1f}% of a core, "
                  f"{on['spans']} spans for {on['requests']} requests", flush=True)
    off_rps = [x["rps"] for x in phases if x["mode"] == "untraced"]
    on_rps = [x["rps"] for x in phases if x["mode"] == "traced"]
    on_phases = [x for x in phases if x["mode"] == "traced"]
    result = {
        "benchmark": "sample OpenAI server, streamed chat, max_tokens 16, closed loop",
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
        "concurrency": args.concurrency, "seconds_per_phase": args.seconds,
        "untraced_rps_median": statistics.median(off_rps),
        "traced_rps_median": statistics.median(on_rps),
        "traced_over_untraced": statistics.median(on_rps) / statistics.median(off_rps),
        "tracer_cpu_share_of_one_core": statistics.median(
            x["tracer_cpu_s"] / x["seconds"] for x in on_phases),
        "tracer_cpu_ms_per_request": statistics.median(
            x["tracer_cpu_s"] * 1000 / max(1, x["requests"]) for x in on_phases),
        "spans_equal_requests": all(x["spans"] == x["requests"] + x["errors"]
                                    or x["spans"] >= x["requests"] for x in on_phases),
        "phases": phases,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\ntraced/untraced requests/s: {result['traced_over_untraced']:.3f} "
          f"({result['traced_rps_median']:.1f} vs {result['untraced_rps_median']:.1f}); "
          f"tracer {result['tracer_cpu_share_of_one_core'] * 100:.1f}% of a core, "
          f"{result['tracer_cpu_ms_per_request']:.2f} ms CPU per request -> {args.out}")


if __name__ == "__main__":
    main()
