"""How long `tokentrace run` takes to take its GPU uprobes off, through uprobe_multi links
and through BCC's perf events (tracer/probes/uprobes.py), on the stand-in libraries
(no GPU needed).

Each round starts the sample workload (samples/gpu/workload.c, with NCCL: libcuda.so.1
and libnccl.so.2 get their probes), traces it for a moment with `--uprobe-links MODE`,
and reads what the tracer says on stopping ("GPU probes detached in S s") and how many
uprobes it attached. Rounds alternate between the modes.

    python bench/detach.py [--rounds 3] [--out bench/results/detach.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from samples.gpu.build import build  # noqa: E402

MODES = ("multi", "perf")


def one_round(workload: Path, mode: str) -> dict:
    w = subprocess.Popen([str(workload), "--wait", "--steps", "20", "--nccl"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert w.stdout.readline().strip() == "ready"
        t = subprocess.run([sys.executable, "-m", "tracer", "run", "--pid", str(w.pid),
                            "--quiet", "--duration", "1", "--uprobe-links", mode],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
        w.stdin.write("go\n")
        w.stdin.flush()
        w.communicate(timeout=60)
    finally:
        if w.poll() is None:
            w.kill()
    if t.returncode != 0:
        raise RuntimeError(f"tokentrace run --uprobe-links {mode}: {t.stderr}")
    took = re.search(r"GPU probes detached in ([\d.]+)s \(([^)]*)\)", t.stderr)
    probes = [int(n) for n in re.findall(r"functions, (\d+) uprobes\)", t.stderr)]
    if took is None or not probes:
        raise RuntimeError(f"no attach/detach lines from tokentrace:\n{t.stderr}")
    return {"mode": mode, "via": took.group(2), "uprobes": sum(probes),
            "detach_s": float(took.group(1))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench/results/detach.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        workload = build(Path(d))["workload"]
        rounds = [one_round(workload, m) for _ in range(args.rounds) for m in MODES]
    res = {"rounds": rounds}
    for m in MODES:
        took = [r["detach_s"] for r in rounds if r["mode"] == m]
        res[m] = {"median_detach_s": statistics.median(took), "range": [min(took), max(took)],
                  "uprobes": rounds[MODES.index(m)]["uprobes"]}
    res["perf_over_multi"] = round(res["perf"]["median_detach_s"]
                                   / max(res["multi"]["median_detach_s"], 1e-6), 1)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
