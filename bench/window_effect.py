"""What `--gpu-sample`'s windows cost the requests they touch, read off a real run.

`bench/real_server.py --window-log DIR` leaves each agent's capture (its ``GpuSampling``
switches: when the launch probes went in and came out), each replica's token arrival
times and requests (send time, TTFT), and the slices' spans. This sorts every token gap
(the time between two tokens of one stream, as its client saw them) and every request's
wait for its first token by what the traced server's probes were doing meanwhile:

- ``window``: it overlaps a window, the launch probes in (each launch a trap);
- ``attach``: it overlaps an attach (the breakpoints going in, before the window);
- ``detach``: it overlaps a detach (the breakpoints coming out, after it);
- ``clear``: none of these.

A longer gap overlaps a window more often whatever the window does, so each class is
compared with the same class against **phantom windows**, the same windows moved half a
period later, where no probe went in (``effect``: the class's mean over the phantoms'
same class's mean). Intervals are bootstraps over the slices.
In untraced slices (``--design crossover``) the same gaps are sorted by the other
half's windows, at the same moments: what a window does to a server it does not trace.
Intervals that overlap a stall of the whole server (``real_server.server_stalls``: HF
serve CB stops for ~0.3 s every 85-100 s, traced or not) are left out, and the stalls
counted apart, with how many met a window and how many a phantom.

    python3 bench/window_effect.py DIR [--out JSON] [--refill RESULT NEW]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.real_server import server_stalls, slice_stalls, summarise, touches  # noqa: E402
from tracer.events.capture import CaptureReader  # noqa: E402
from tracer.events.gpu import GpuSampling  # noqa: E402
from tracer.events.schema import TracingPaused  # noqa: E402

CLASSES = ("window", "attach", "detach", "clear")
BOOTSTRAP = 400


@dataclass(frozen=True)
class Window:
    """One sampling window, monotonic seconds: the attach began, the probes counted
    from ``on`` to ``off``, the detach ended (``detach_end``)."""

    attach_start: float
    on: float
    off: float
    detach_end: float

    def shifted(self, dt: float) -> Window:
        return Window(self.attach_start + dt, self.on + dt, self.off + dt,
                      self.detach_end + dt)


def windows_of(switches: Iterable[Any]) -> list[Window]:
    """The windows of a capture's ``GpuSampling`` switches and ``TracingPaused`` events
    (in order; a pause ends an open window, its probes out with the rest). An "on" switch
    is stamped after its attach (``attach_s`` long) and says how long the detach before
    it took (``detach_s``); a window still open at the end, or one before sampling
    ended (an "on" at fraction 1), is closed there; a last detach of unknown length
    takes the median of the others."""
    wins: list[list[float]] = []
    open_on: float | None = None
    for s in switches:
        t = s.ts / 1e9
        if isinstance(s, TracingPaused):
            if s.paused and open_on is not None:  # every probe out, the window with them
                wins[-1][2] = wins[-1][3] = t
                open_on = None
            continue
        if s.enabled and s.fraction < 1.0:
            if wins and s.detach_s:
                wins[-1][3] = wins[-1][2] + s.detach_s
            if open_on is None:
                open_on = t
                wins.append([t - s.attach_s, t, t, t])
        elif open_on is not None:  # off, or every launch counted from now on
            wins[-1][2] = wins[-1][3] = t
            open_on = None
    detaches = [w[3] - w[2] for w in wins if w[3] > w[2]]
    typical = statistics.median(detaches) if detaches else 0.0
    for w in wins:
        if w[3] == w[2]:
            w[3] = w[2] + typical
    return [Window(*w) for w in wins if w[2] > w[1]]


def classify(a: float, b: float, wins: Sequence[Window], starts: Sequence[float]) -> str:
    """The class of the interval [a, b] against ``wins`` (sorted by ``attach_start``,
    ``starts`` their attach starts): ``window`` before ``attach`` before ``detach``."""
    # windows that can overlap: those whose attach began before b, the last few of them
    k = bisect_right(starts, b)
    found = "clear"
    for w in wins[max(0, k - 3):k]:
        if a < w.off and b > w.on:
            return "window"
        if a < w.on and b > w.attach_start:
            found = "attach"
        elif found == "clear" and a < w.detach_end and b > w.off:
            found = "detach"
    return found


def token_gaps(client: dict[str, Any]) -> list[tuple[float, float]]:
    """Each stream's gaps between its consecutive tokens (the gap before a request's
    first token is its TTFT, not a gap)."""
    gaps = []
    for stamps, first in zip(client["stamps"], client["first"]):
        firsts = {round(t0 + ttft, 9) for t0, ttft in first if ttft is not None}
        for prev, cur in zip(stamps, stamps[1:]):
            if round(cur, 9) not in firsts:
                gaps.append((prev, cur))
    return gaps


def requests(client: dict[str, Any]) -> list[tuple[float, float]]:
    """Each request's [sent, first token]."""
    return [(t0, t0 + ttft) for first in client["first"] for t0, ttft in first
            if ttft is not None]


def in_slices(items: list[tuple[float, float]], slices: list[dict[str, Any]],
              stalls: Sequence[tuple[float, float]] = ()) -> list[list[tuple[float, float]]]:
    """The items wholly inside each slice, a list per slice; those that overlap one of
    ``stalls`` left out."""
    items = sorted(items)
    keys = [a for a, _ in items]
    out = []
    for s in slices:
        t0, t1 = s["t0"], s["t0"] + s["wall_s"]
        out.append([it for it in items[bisect_left(keys, t0):bisect_left(keys, t1)]
                    if it[1] <= t1 and not touches(it[0], it[1], stalls)])
    return out


def run_stalls(client: dict[str, Any], slices: list[dict[str, Any]]
               ) -> list[tuple[float, float]]:
    """The server's stalls (``server_stalls``) in these slices, each once."""
    found: set[tuple[float, float]] = set()
    for s in slices:
        found.update(server_stalls(client["stamps"], s["t0"], s["t0"] + s["wall_s"])[0])
    return sorted(found)


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def sorted_by_class(per_slice: list[list[tuple[float, float]]], wins: Sequence[Window]
                    ) -> list[dict[str, list[float]]]:
    """Per slice, each class's interval lengths (ms)."""
    wins = sorted(wins, key=lambda w: w.attach_start)
    starts = [w.attach_start for w in wins]
    out = []
    for items in per_slice:
        by: dict[str, list[float]] = {c: [] for c in CLASSES}
        for a, b in items:
            by[classify(a, b, wins, starts)].append((b - a) * 1e3)
        out.append(by)
    return out


def _effects(real: list[dict[str, list[float]]], phantom: list[dict[str, list[float]]],
             idx: Sequence[int]) -> dict[str, float]:
    """Each class's mean over the phantoms' same class's mean, on slices ``idx``. Both
    are alike in length (a longer interval meets a window, real or phantom, more often),
    and a phantom half a period from every real window meets none of them."""
    out = {}
    for c in CLASSES[:-1]:
        xs = [x for i in idx for x in real[i][c]]
        ph = [x for i in idx for x in phantom[i][c]]
        out[c] = statistics.fmean(xs) / statistics.fmean(ph) if xs and ph else float("nan")
    return out


def compare(real: list[dict[str, list[float]]], phantom: list[dict[str, list[float]]],
            seed: int = 0) -> dict[str, Any]:
    """Each class, real windows and phantoms: counts, means, quantiles, and ``effect``
    (the real class's mean over the phantoms') with a bootstrap 95% interval over
    slices."""
    n = len(real)
    rng = random.Random(seed)
    boots = [_effects(real, phantom, [rng.randrange(n) for _ in range(n)])
             for _ in range(BOOTSTRAP)] if n else []
    point = _effects(real, phantom, range(n))
    out: dict[str, Any] = {}
    for c in CLASSES:
        xs = [x for by in real for x in by[c]]
        ph = [x for by in phantom for x in by[c]]
        row: dict[str, Any] = {"n": len(xs), "mean_ms": round(statistics.fmean(xs), 3) if xs else None,
                               "p50_ms": round(quantile(xs, 0.5), 3),
                               "p99_ms": round(quantile(xs, 0.99), 3),
                               "phantom_n": len(ph),
                               "phantom_mean_ms": round(statistics.fmean(ph), 3) if ph else None}
        if c != "clear":
            vals = sorted(b[c] for b in boots if b[c] == b[c])
            row["effect"] = round(point[c], 4)
            if len(vals) >= 20:
                row["effect_ci95"] = [round(quantile(vals, 0.025), 4),
                                      round(quantile(vals, 0.975), 4)]
        out[c] = row
    return out


def tail_without(real: list[dict[str, list[float]]], phantom: list[dict[str, list[float]]],
                 q: float = 0.99) -> dict[str, Any]:
    """The q-quantile of every interval, and of those left when the ones touching a
    window, attach or detach are left out: real and phantom. Where the windows make the
    tail, leaving their intervals out lowers it more than leaving the phantoms' out."""
    every = [x for by in real for c in CLASSES for x in by[c]]
    clear = [x for by in real for x in by["clear"]]
    ph_clear = [x for by in phantom for x in by["clear"]]
    allq = quantile(every, q)
    return {"all_ms": round(allq, 3),
            "clear_ms": round(quantile(clear, q), 3),
            "phantom_clear_ms": round(quantile(ph_clear, q), 3),
            "all_over_clear": round(allq / quantile(clear, q), 4) if clear else None,
            "all_over_phantom_clear": round(allq / quantile(ph_clear, q), 4) if ph_clear else None}


def analyse(log: Path) -> dict[str, Any]:
    """Every replica's traced (and, crossover, untraced) slices of a ``--window-log``."""
    meta = json.loads((log / "slices.json").read_text())
    agents: dict[str, list[Window]] = {}
    for name in sorted(set(meta["agent_of_replica"].values())):
        path = log / f"{name}.ttcap"
        agents[name] = windows_of(i for i in CaptureReader(path)
                                  if isinstance(i, (GpuSampling, TracingPaused))
                                  ) if path.exists() else []
    others = {a: [b for b in agents if b != a] for a in agents}
    every = [w for ws in agents.values() for w in ws]
    periods = [b.on - a.on for ws in agents.values() for a, b in zip(ws, ws[1:])]
    period = statistics.median(periods) if periods else 1.0
    doc: dict[str, Any] = {
        "windows": {a: len(ws) for a, ws in agents.items()},
        "period_s": round(period, 4),
        "window_ms_median": round(statistics.median((w.off - w.on) * 1e3 for w in every), 2)
        if every else None,
        "attach_ms_median": round(statistics.median((w.on - w.attach_start) * 1e3
                                                    for w in every), 2) if every else None,
        "detach_ms_median": round(statistics.median((w.detach_end - w.off) * 1e3
                                                    for w in every), 2) if every else None,
        "phantom_shift_s": round(period / 2, 4)}
    groups: dict[str, dict[str, list[Any]]] = {}
    for rep, name in meta["agent_of_replica"].items():
        cpath = log / f"client-{rep}.json"
        if not cpath.exists():
            continue
        client = json.loads(cpath.read_text())
        mine = [s for s in meta["slices"] if str(s["replica"]) == rep]
        for mode, wins in (("full", agents[name]),
                           ("untraced", [w for o in others[name] for w in agents[o]])):
            slices = [s for s in mine if s["mode"] == mode]
            if not wins or not slices:
                continue
            g = groups.setdefault(mode, {"gaps": [], "gaps_ph": [], "ttft": [], "ttft_ph": [],
                                         "stalls": [0, 0, 0], "slice_s": 0.0})
            phantom = [w.shifted(period / 2) for w in wins]
            stalls = run_stalls(client, slices)
            g["slice_s"] += sum(s["wall_s"] for s in slices)
            g["stalls"][0] += len(stalls)
            for k, ws in ((1, wins), (2, phantom)):  # stalls met by a window, attach to end
                g["stalls"][k] += sum(1 for a, b in stalls if any(
                    a < w.detach_end and b > w.attach_start for w in ws))
            gaps = in_slices(token_gaps(client), slices, stalls)
            reqs = in_slices(requests(client), slices, stalls)
            g["gaps"] += sorted_by_class(gaps, wins)
            g["gaps_ph"] += sorted_by_class(gaps, phantom)
            g["ttft"] += sorted_by_class(reqs, wins)
            g["ttft_ph"] += sorted_by_class(reqs, phantom)
    for mode, g in groups.items():
        n, real, ph = g["stalls"]
        doc[mode] = {"slices": len(g["gaps"]),
                     # stalls of the whole server in these slices (their intervals are left
                     # out of the rest), and those that met a window (attach to detach's
                     # end), real or phantom
                     "stalls": {"n": n, "per_minute": round(60 * n / g["slice_s"], 3),
                                "meeting_windows": real, "meeting_phantoms": ph},
                     "token_gaps": compare(g["gaps"], g["gaps_ph"]),
                     "ttft": compare(g["ttft"], g["ttft_ph"]),
                     "ttft_p99": tail_without(g["ttft"], g["ttft_ph"]),
                     "token_gap_p99": tail_without(g["gaps"], g["gaps_ph"])}
    return doc


def refill(result: Path, log: Path, out: Path) -> None:
    """A run's result (``--out``) from before the bench kept its slices' stalls, with
    them (``slice_stalls``, from the ``--window-log`` of that run) and its statistics
    summarised again, to ``out`` (for ``real_server.py --pool``)."""
    doc = json.loads(result.read_text())
    meta = json.loads((log / "slices.json").read_text())
    at = {(s["replica"], s["round"], s["mode"]): s["t0"] for s in meta["slices"]}
    clients = {int(rep): json.loads((log / f"client-{rep}.json").read_text())
               for rep in meta["agent_of_replica"]}
    for r in doc["results"]:
        for w in r["slices"]:
            t0 = at[(w["replica"], w["round"], w["mode"])]
            c = clients[w["replica"]]
            w.update(slice_stalls(c["stamps"], c["first"], t0, t0 + w["wall_s"]))
        modes = sorted({w["mode"] for w in r["slices"]} - {"untraced", "full"})
        r.update(summarise(r["slices"], ["untraced", "full", *modes]))
    out.write_text(json.dumps(doc, separators=(",", ":")) + "\n")


def table(doc: dict[str, Any]) -> str:
    lines = [f"windows {doc['windows']}, period {doc['period_s']} s, window "
             f"{doc['window_ms_median']} ms, attach {doc['attach_ms_median']} ms, detach "
             f"{doc['detach_ms_median']} ms"]
    for mode in ("full", "untraced"):
        if mode not in doc:
            continue
        for what in ("token_gaps", "ttft"):
            for c, row in doc[mode][what].items():
                lines.append(f"{mode:9} {what:10} {c:7} n={row['n']:<7} mean {row['mean_ms']} ms"
                             f" (phantom {row['phantom_mean_ms']})"
                             + (f" effect {row['effect']} {row.get('effect_ci95')}"
                                if "effect" in row else ""))
        lines.append(f"{mode:9} ttft p99 {doc[mode]['ttft_p99']}")
        lines.append(f"{mode:9} stalls {doc[mode]['stalls']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path, help="a bench/real_server.py --window-log DIR")
    ap.add_argument("--out", help="write the JSON here too")
    ap.add_argument("--refill", nargs=2, metavar=("RESULT", "NEW"), type=Path,
                    help="also write RESULT (that run's --out) with its slices' stalls "
                         "read off the log, summarised again, to NEW")
    args = ap.parse_args(argv)
    if args.refill:
        refill(args.refill[0], args.log, args.refill[1])
    doc = analyse(args.log)
    print(table(doc))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
