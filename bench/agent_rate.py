"""Does the agent keep up? Synthetic streaming traffic at a set rate, replayed through
the analysis (``Pipeline.feed``, the path of `run` and `replay`) on one CPU, by this
tree and by an earlier commit of it, in one run.

    python bench/agent_rate.py [--rate 1000] [--tokens 100] [--seconds 4] [--servers 8]
        [--against 49e8c84] [--cpu 1] [--out bench/results/agent_rate.json]

The traffic (``bench/streamgen.py``) is what the probes send for ``--servers`` OpenAI
servers streaming chat completions: ``--rate`` requests/s of ``--tokens`` tokens,
one write per token, keep-alive connections, socket-timing records, written to a
capture file once and replayed by each tree in its own process pinned to ``--cpu``.
Two cases: sockets only, and with each server's engine steps as the CUDA probes report
them (one kernel burst per decode step, every running request a member: the GPU
attribution's work grows with tokens, not requests). Per tree and case: CPU seconds
for the whole replay against the traffic's own seconds (under 1: it keeps up), the
steady part (the middle of the run, once every connection is open), the sustainable
requests/s (requests over CPU seconds), and whether nothing was lost: every request
exported, with exactly its tokens, its TTFT (first token's write - request's read) and
its usage, and no parser error. ``--against`` names the commit to compare with
(``git archive`` into a temporary directory; default: where this branch left main).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def child(tree: Path, cap: Path, truth_path: Path, cpu: int, steady: tuple[int, int]
          ) -> dict[str, Any]:
    """Replay ``cap`` with the code of ``tree`` in a fresh process pinned to ``cpu``."""
    code = r'''
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from tracer.correlate.connections import TrackerOptions
from tracer.events import capture
from tracer.pipeline import Pipeline
cap, truth_path, cpu, s0, s1 = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
os.sched_setaffinity(0, {cpu})
reader = capture.CaptureReader(cap)
items = list(reader)
recs = []
class Sink:
    def on_record(self, r): recs.append(r)
    def close(self): pass
p = Pipeline([Sink()], options=TrackerOptions(tenant_salt=capture.tenant_salt(reader.header)))
marks = {}
t0 = time.process_time()
for it in items:
    p.feed(it)
    if s0 <= p.last_ts and "s0" not in marks:
        marks["s0"] = time.process_time()
    if s1 <= p.last_ts and "s1" not in marks:
        marks["s1"] = time.process_time()
p.close()
cpu_s = time.process_time() - t0
truth = json.load(open(truth_path))
by = {(r.pid, r.fd, r.start_ns): r for r in recs}
wrong = {"missing": 0, "tokens": 0, "ttft": 0, "token_times": 0, "usage": 0}
for t in truth:
    r = by.get((t["pid"], t["fd"], t["read_ts"]))
    if r is None or r.llm_response is None:
        wrong["missing"] += 1
        continue
    lr = r.llm_response
    wrong["tokens"] += lr.output_tokens != t["tokens"]
    wrong["ttft"] += r.ttft_ns != t["first_token_ts"] - t["read_ts"]
    wrong["token_times"] += (len(lr.token_ts) != t["tokens"] or lr.token_ts[0] != t["first_token_ts"]
                             or lr.token_ts[-1] != t["last_token_ts"])
    wrong["usage"] += lr.usage_source != ("usage" if t["include_usage"] else "stream_chunks")
rep = p.report()
print(json.dumps({"records": len(items), "requests_sent": len(truth), "exported": p.records,
                  "cpu_s": round(cpu_s, 3),
                  "steady_cpu_s": round(marks.get("s1", 0) - marks.get("s0", 0), 3),
                  "wrong": wrong, "parser_errors": rep.get("parser_errors", 0),
                  "gpu_steps_charged": rep.get("gpu_step_launches_charged", 0),
                  "gpu_step_launches": rep.get("gpu_step_launches", 0)}))
'''
    out = subprocess.run([sys.executable, "-c", code, str(tree), str(cap), str(truth_path),
                          str(cpu), str(steady[0]), str(steady[1])],
                         capture_output=True, text=True, cwd=tree)
    if out.returncode != 0:
        raise SystemExit(f"replay with {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def archive(ref: str, dest: Path) -> str:
    """``ref``'s tree (tracked files) into ``dest``; returns its commit id."""
    sha = subprocess.run(["git", "rev-parse", ref], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    tar = subprocess.run(["git", "archive", sha], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar.stdout, check=True)
    return sha


def default_against() -> str:
    return subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip() or "HEAD"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=1000.0, help="requests/s in all")
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=4.0, help="seconds of traffic")
    ap.add_argument("--servers", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--against", default=None, help="commit to compare with")
    ap.add_argument("--cpu", type=int, default=1, help="the CPU the replays run on")
    ap.add_argument("--cases", default="sockets,gpu,sockets+runs,gpu+runs",
                    help="traffic: sockets only, with GPU steps; +runs: as the kernel sends "
                         "it with token runs (bpf/sockets.c; bench/streamgen.py stage_runs)")
    ap.add_argument("--arm-delay-ms", type=float, default=20.0,
                    help="+runs: a response is armed this long after its first token")
    ap.add_argument("--out", default=str(ROOT / "bench/results/agent_rate.json"))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from bench.streamgen import BASE_TS, generate, stage_runs
    from tracer.events import capture

    against = args.against or default_against()
    here = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=ROOT, capture_output=True, text=True).stdout.strip())
    results: dict[str, Any] = {
        "rate": args.rate, "tokens": args.tokens, "seconds": args.seconds,
        "servers": args.servers, "step_ms": args.step_ms, "cpu": args.cpu,
        "python": sys.version.split()[0], "commit": here + ("+dirty" if dirty else ""),
        "cases": {}}
    # the steady window: from when every connection is open (a request's lifetime
    # after the start) to the last arrival
    life_s = args.tokens * args.step_ms / 1000 + 0.1
    steady = (BASE_TS + int(min(life_s, args.seconds / 2) * 1e9),
              BASE_TS + int(args.seconds * 1e9))
    steady_s = (steady[1] - steady[0]) / 1e9
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp, "base")
        base.mkdir()
        results["against"] = archive(against, base)
        for case in args.cases.split(","):
            t0 = time.monotonic()
            items, truth = generate(args.rate, args.tokens, args.seconds, args.servers,
                                    args.step_ms, gpu=case.startswith("gpu"))
            if case.endswith("+runs"):
                items = stage_runs(items, int(args.arm_delay_ms * 1e6))
            cap = Path(tmp, f"{case}.ttcap")
            header = capture.new_header(command="bench")
            if not case.endswith("+runs"):  # no record an earlier tree cannot read
                header["wire_version"] = 8
            w = capture.CaptureWriter(cap, header, keep_secrets=True)
            for it in items:
                w.write(it)
            w.close()
            truth_path = Path(tmp, f"{case}.truth.json")
            truth_path.write_text(json.dumps([asdict(t) for t in truth]))
            print(f"{case}: {len(items)} records, {len(truth)} requests "
                  f"(generated in {time.monotonic() - t0:.1f}s)", file=sys.stderr)
            row: dict[str, Any] = {"records": len(items), "requests": len(truth)}
            # an earlier tree that does not read RUN records (before tracer/events/runs.py):
            # its +runs cases compare with this tree's own per-write case
            old_runs = case.endswith("+runs") and not (base / "tracer/events/runs.py").exists()
            trees = (("now", ROOT),) if old_runs else (("before", base), ("now", ROOT))
            for name, tree in trees:
                r = child(tree, cap, truth_path, args.cpu, steady)
                r["traffic_s"] = args.seconds
                r["cpu_per_traffic_s"] = round(r["cpu_s"] / args.seconds, 3)
                r["steady_cpu_per_traffic_s"] = round(r["steady_cpu_s"] / steady_s, 3)
                r["requests_per_cpu_s"] = round(len(truth) / r["cpu_s"], 1)
                r["steady_requests_per_cpu_s"] = round(
                    args.rate * steady_s / r["steady_cpu_s"], 1) if r["steady_cpu_s"] else None
                r["records_per_cpu_s"] = round(len(items) / r["cpu_s"])
                r["keeps_up"] = r["steady_cpu_per_traffic_s"] <= 1.0
                r["nothing_lost"] = (r["exported"] == len(truth) and not any(r["wrong"].values())
                                     and not r["parser_errors"])
                row[name] = r
                print(f"  {name}: {json.dumps(r)}", file=sys.stderr)
            results["cases"][case] = row
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
