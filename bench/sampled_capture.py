"""Two captures of one saturated real server on a GPU, one after the other under the same
load: every launch counted, then ``--gpu-sample F``; for bench/sampling_error.py (the
first, with sampling imposed on it) and for the live sampled path (the second: its
estimated launches and GPU time per output token against the first's exact ones).

Run on the GPU host as root, after ``eval "$(.gpu/setup-bcc.sh)"``:

    python3 bench/sampled_capture.py OUT_DIR [--seconds 45] [--fraction 0.1 | --auto]
                                     [--period-s 1] [--concurrency 32]

Writes OUT_DIR/full.ttcap, OUT_DIR/sampled.ttcap and OUT_DIR/sampled_capture.json
(tokens the client saw in each capture's span, the agents' summaries' GPU totals,
reconciliations and step counters).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from real_server import Agent, Client, Server, cpu_times, plan_cpus  # noqa: E402


def capture(server: Server, client: Client, out: Path, name: str, seconds: float,
            agent_args: list[str], cpus: set[int], profile: bool = False) -> dict[str, Any]:
    work = out / f"agent-{name}"
    work.mkdir(exist_ok=True)
    agent = Agent(server, work, cpus, ["--record", str(out / f"{name}.ttcap"), *agent_args],
                  profile=str(out / f"agent-{name}") if profile else None)
    time.sleep(2.0)  # naming settles (the stub window closes by itself)
    a0 = cpu_times(agent.proc.pid)
    t0 = time.monotonic()
    time.sleep(seconds)
    t1 = time.monotonic()
    a1 = cpu_times(agent.proc.pid)
    seen = client.slice(t0, t1)
    seen.pop("ttft_ms", None)
    summary = agent.stop()
    procs = summary.get("gpu", {}).get("processes", [])
    report = summary.get("report", {})
    return {"seconds": round(t1 - t0, 2), "client": seen,
            # the live agent's CPU in those seconds: against a replay of the capture
            # (bench/agent_throughput.py), what the live agent does beyond the analysis
            "agent_cpu_s": round(sum(a1) - sum(a0), 3), "agent_sys_s": round(a1[1] - a0[1], 3),
            "gpu": [{k: p.get(k) for k in ("pid", "kernel_launches", "kernel_launches_seen",
                                           "graph_launches", "sync_calls", "bursts")}
                    for p in procs],
            "launch_sampling": summary.get("gpu", {}).get("launch_sampling"),
            "reconciliation": summary.get("reconciliation"),
            "step_counters": {k: v for k, v in report.items() if "gpu_step" in k},
            "lost": {k: v for k, v in report.items() if "lost" in k}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--server", default="hf-cb")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seconds", type=float, default=45.0)
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--period-s", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", default="24:150")
    ap.add_argument("--warmup-s", type=float, default=10.0)
    ap.add_argument("--profile-agent", action="store_true",
                    help="each agent under cProfile with its garbage collections timed "
                         "(OUT_DIR/agent-NAME.prof, agent-NAME-gc.json; "
                         "bench/profiled_agent.py)")
    ap.add_argument("--auto", action="store_true",
                    help="the second capture with the agent's default, --gpu-sample auto "
                         "(its choice of fraction and of what is switched), not --fraction")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cpus = plan_cpus()
    server = Server(args.server, args.device, args.out, cpus["server"])
    args.model = server.model
    client = Client(server, args, cpus["client"])
    doc: dict[str, Any] = {"server": args.server, "device": args.device,
                           "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                           "fraction": "auto" if args.auto else args.fraction,
                           "period_s": args.period_s}
    try:
        client.ask("start")
        client.first_tokens()
        time.sleep(args.warmup_s)
        doc["full"] = capture(server, client, args.out, "full", args.seconds, [],
                              cpus["agent"], args.profile_agent)
        doc["sampled"] = capture(server, client, args.out, "sampled", args.seconds,
                                 ["--gpu-sample", "auto"] if args.auto else
                                 ["--gpu-sample", f"{args.fraction:g}",
                                  "--gpu-sample-period", f"{args.period_s:g}"],
                                 cpus["agent"], args.profile_agent)
        doc["load"] = client.ask("stop")
    finally:
        client.close()
        server.stop()
    text = json.dumps(doc, indent=1)
    (args.out / "sampled_capture.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
