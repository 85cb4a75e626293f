"""Long fuzzing runs of every layer a peer's bytes reach (the short ones run in CI as
tests/test_fuzz.py, with the same targets: tests/fuzz_targets.py).

    python bench/fuzz.py                      # 100k cases per layer, all layers
    python bench/fuzz.py --cases 1000 http1   # one layer, quickly
    python bench/fuzz.py --out bench/results/fuzz.json

Each case mutates a real seed (a committed capture's traffic, hyper-h2 conversations,
KServe protobufs), cuts it at random and feeds it to the layer, whose invariants the
target checks. Failures are kept with their case (seed, mutations, cuts) to replay with
``replay_case``; the JSON written holds cases, time and failures per layer.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fuzz_targets import TARGETS, random_case  # noqa: E402


def run_layer(name: str, cases: int, seed: int, keep: int = 20) -> dict:
    target, corpus = TARGETS[name]
    size = len(corpus())
    rng = random.Random(f"{name}:{seed}")
    failures: list[dict] = []
    kinds: dict[str, int] = {}
    t0 = time.monotonic()
    for _ in range(cases):
        idx, ops, splits = random_case(rng, size)
        case_seed = idx + size * rng.randrange(1 << 16)  # the bits above pick modes
        try:
            target(case_seed, ops, splits)
        except Exception as e:  # a finding: keep it to replay
            key = f"{type(e).__name__}: {str(e)[:120]}"
            kinds[key] = kinds.get(key, 0) + 1
            if len(failures) < keep:
                failures.append({"seed": case_seed, "ops": [(k, p, b.hex()) for k, p, b in ops],
                                 "splits": splits, "error": key,
                                 "where": traceback.format_exc(limit=-3)})
    secs = time.monotonic() - t0
    return {"cases": cases, "seconds": round(secs, 1), "cases_per_s": round(cases / secs),
            "failures": sum(kinds.values()), "failure_kinds": kinds, "examples": failures}


def replay_case(layer: str, case: dict) -> None:
    """Run one recorded failing case again (raises what it raised)."""
    ops = [(k, p, bytes.fromhex(b)) for k, p, b in case["ops"]]
    TARGETS[layer][0](case["seed"], ops, case["splits"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("layers", nargs="*", help=f"some of {', '.join(TARGETS)} (default: all)")
    ap.add_argument("--cases", type=int, default=100_000, help="cases per layer")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", help="write the results as JSON here (layers not run are kept "
                                  "from the file's earlier results)")
    args = ap.parse_args()
    layers = args.layers or list(TARGETS)
    results = {}
    for name in layers:
        r = run_layer(name, args.cases, args.seed)
        results[name] = r
        print(f"{name:8} {r['cases']:>8} cases {r['seconds']:>7.1f}s "
              f"{r['cases_per_s']:>7}/s failures {r['failures']}", flush=True)
        for k, n in r["failure_kinds"].items():
            print(f"         {n} x {k}")
    command = " ".join(["python", "bench/fuzz.py", *sys.argv[1:]])
    for r in results.values():
        r["command"] = command
    doc = {"host": platform.node(), "python": platform.python_version(), "seed": args.seed,
           "layers": results}
    if args.out:
        out = Path(args.out)
        if out.exists():
            old = json.loads(out.read_text()).get("layers", {})
            doc["layers"] = {**old, **results}
        out.write_text(json.dumps(doc, indent=1) + "\n")
    return 1 if any(r["failures"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
