"""Which calls mark every engine step of a capture's step threads: for the design of
sampling the syncs (docs/overhead.md, "where the rest is").

Steps are counted at the sync that brings results back (tracer/correlate/steps.py). For
the sync probes to go off with the launch probes, a step must be delimited in the off
windows by a call whose probe stays on, made exactly once a step: the tokens'
device-to-host copy, which now ends a step while the syncs are off. Per thread with 50
steps or more, this replays the capture's bursts into ``StepLog`` (as the correlator does) and
reports how many steps made 0, 1, 2... device-to-host copies, syncs and memsets, and
the memsets per step by the bytes of the step's device-to-host copy.

    python3 bench/step_markers.py [CAPTURE ...] [--out bench/results/step_markers-h100.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from sampling_error import DEFAULT_CAPTURES, load  # noqa: E402
from tracer.correlate.steps import StepLog  # noqa: E402
from tracer.events.gpu import COPY_KINDS, KernelBurst  # noqa: E402

MIN_STEPS = 50
D2H = COPY_KINDS.index("d2h")


def markers(path: Path) -> list[dict[str, Any]]:
    """Per step thread of the capture: its steps and the calls per step."""
    items, _ = load(path)
    logs: dict[tuple[int, int], StepLog] = {}
    for item in items:
        if isinstance(item, KernelBurst):
            key = (item.pid, item.tid)
            logs.setdefault(key, StepLog(*key)).add_burst(item)
    out = []
    for (pid, tid), log in sorted(logs.items()):
        log.finish()
        steps = log.steps
        if len(steps) < MIN_STEPS:
            continue

        def per_step(counts: Counter[int]) -> dict[str, int]:
            return {str(k): n for k, n in sorted(counts.items())}

        d2h = Counter(s.copy_calls[D2H] for s in steps)
        # which steps make memsets: by the bytes their tokens' copy back moved (the
        # batch's size), the key the memsets' estimate uses (sampling.StepEstimates)
        by_size: dict[int, Counter[int]] = {}
        for st in steps:
            size = int(st.work.get("memcpy_bytes.d2h", 0))
            by_size.setdefault(size, Counter())[st.memset_calls] += 1
        out.append({"pid": pid, "tid": tid, "steps": len(steps),
                    "d2h_copies_per_step": per_step(d2h),
                    "steps_with_one_d2h_copy": round(d2h[1] / len(steps), 4),
                    "syncs_per_step": per_step(Counter(s.sync_calls for s in steps)),
                    "memsets_per_step": per_step(Counter(s.memset_calls for s in steps)),
                    "memsets_per_step_by_d2h_bytes": {str(b): per_step(c) for b, c
                                                      in sorted(by_size.items())}})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("captures", nargs="*", type=Path, default=DEFAULT_CAPTURES)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/step_markers-h100.json")
    args = ap.parse_args(argv)
    result = {"bench": "step_markers", "captures": []}
    for path in args.captures:
        threads = markers(path)
        result["captures"].append({"capture": path.name, "threads": threads})
        for t in threads:
            print(f"{path.name} {t['pid']}/{t['tid']}: {t['steps']} steps, one d2h copy in "
                  f"{t['steps_with_one_d2h_copy']:.2%}; d2h {t['d2h_copies_per_step']}, "
                  f"syncs {t['syncs_per_step']}, memsets {t['memsets_per_step']}",
                  file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
