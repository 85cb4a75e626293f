"""`tokentrace run` under cProfile, with the time the cyclic garbage collector takes
counted per generation: to see where a live agent's CPU goes that a replay of its
capture does not spend (bench/sampled_capture.py --profile-agent runs it).

    python bench/profiled_agent.py OUT_PREFIX run --pid PID ...   (tokentrace's arguments)

Writes OUT_PREFIX.prof (pstats) and OUT_PREFIX-gc.json (collections and seconds per
generation, the largest pause) when the agent exits (SIGINT, as `run` expects).
"""

from __future__ import annotations

import cProfile
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    prefix, argv = sys.argv[1], sys.argv[2:]
    started: list[float] = [0.0]
    stats: dict[int, list[float]] = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
    longest = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        row = stats[info["generation"]]
        row[0] += 1
        row[1] += took
        longest[0] = max(longest[0], took)

    gc.callbacks.append(on_gc)
    from tracer.cli import main as tokentrace
    profile = cProfile.Profile()
    rc = 0
    try:
        rc = profile.runcall(tokentrace, argv)
    finally:
        profile.dump_stats(prefix + ".prof")
        Path(prefix + "-gc.json").write_text(json.dumps({
            "collections": {g: r[0] for g, r in stats.items()},
            "seconds": {g: round(r[1], 3) for g, r in stats.items()},
            "longest_s": round(longest[0], 4),
            "objects_tracked": len(gc.get_objects())}) + "\n")
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
