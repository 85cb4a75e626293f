"""The agent's own throughput: captures replayed through ``Pipeline.feed`` (the one
analysis path of `run` and `replay`) on one CPU, as fast as it goes.

    python bench/agent_throughput.py [CAPTURE ...] [--rounds 3] [--cpu 0]
        [--against REF] [--out bench/results/agent_throughput.json]

Per capture: records, requests exported, and the best of ``--rounds`` runs in records/s
and requests/s (the decoding of the file is not timed: items are read first). Default
captures: the committed H100 HF serve runs (continuous batching at concurrency 32, and
the one the attribution issue was filed with) and the HTTP/1 OpenAI sample.
``--against REF`` replays the same captures with that commit's code as well (``git
archive`` into a temporary directory, its own copy of this script), in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracer.correlate.connections import TrackerOptions  # noqa: E402
from tracer.events import capture  # noqa: E402
from tracer.pipeline import Pipeline  # noqa: E402

DEFAULT = [ROOT / "samples/captures/hf-cb-c32-h100.ttcap",
           ROOT / "samples/captures/hf-serve-cb-h100.ttcap",
           ROOT / "samples/captures/openai-http1.ttcap"]


def measure(path: Path, rounds: int) -> dict[str, Any]:
    reader = capture.CaptureReader(path)
    items = list(reader)
    salt = capture.tenant_salt(reader.header)
    best, requests = float("inf"), 0
    for _ in range(rounds):
        p = Pipeline([], options=TrackerOptions(tenant_salt=salt,
                                                secrets_masked=reader.header.get("secrets_masked") is True))
        t0 = time.process_time()
        for item in items:
            p.feed(item)
        p.close()
        best = min(best, time.process_time() - t0)
        requests = p.records
    raw = sum(1 for i in items if isinstance(i, bytes))
    return {"capture": path.name, "records": len(items), "ring_buffer_records": raw,
            "requests": requests, "cpu_s": round(best, 3),
            "records_per_s": round(len(items) / best), "requests_per_s": round(requests / best, 1),
            "records_per_request": round(len(items) / requests, 1) if requests else None}


def against(args: argparse.Namespace) -> dict[str, Any]:
    """The same captures replayed by ``args.against``'s own code and script."""
    import subprocess
    import tempfile

    sha = subprocess.run(["git", "rev-parse", args.against], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        tar = subprocess.run(["git", "archive", sha], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=tar.stdout, check=True)
        out = Path(tmp, "result.json")
        subprocess.run([sys.executable, str(Path(tmp, "bench/agent_throughput.py")),
                        *map(str, args.captures), "--rounds", str(args.rounds), "--cpu",
                        str(args.cpu), "--out", str(out)], cwd=tmp, check=True,
                       capture_output=True)
        doc = json.loads(out.read_text())
    return {"commit": sha, "results": doc["results"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("captures", nargs="*", type=Path, default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu", type=int, default=0, help="the CPU to run on")
    ap.add_argument("--against", help="also replay with this commit's code")
    ap.add_argument("--out", default=str(ROOT / "bench/results/agent_throughput.json"))
    args = ap.parse_args(argv)
    os.sched_setaffinity(0, {args.cpu})
    results = [measure(p, args.rounds) for p in args.captures]
    out: dict[str, Any] = {"cpu": args.cpu, "rounds": args.rounds,
                           "python": sys.version.split()[0], "results": results}
    if args.against:
        out["against"] = against(args)
        for now, before in zip(results, out["against"]["results"]):
            now["speedup"] = round(before["cpu_s"] / now["cpu_s"], 2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
