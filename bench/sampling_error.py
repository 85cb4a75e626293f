"""The error ``--gpu-sample`` puts on each request's GPU numbers, measured on captures
recorded on real GPUs with every launch counted.

Each capture is replayed twice through ``Pipeline.feed``: as recorded (the truth), and
with the launch probes' sampling imposed on it. For the second, the launch probes are on
for FRACTION of each PERIOD: a burst not wholly inside an "on" window loses its launches
and kernels, as it would with the probes detached (its copies, memsets and syncs stay:
those probes stay on, but see ``--copies``), and the switches arrive as ``GpuSampling`` events, as the agent
sends them. Per request, the kernel launches and GPU time charged are then compared
with the truth; the totals charged, and the conservation (charged plus unattributed
equals observed), are checked in both.

One thing the imposed sampling cannot reproduce: with the launch probes off, a burst's
first time stamp is its first copy or sync, not its first launch. The estimate of a
step's start does not use it (``tracer/correlate/sampling.py``), so this does not
flatter the result.

    python3 bench/sampling_error.py [CAPTURE ...] [--fraction 0.1] [--period-s 1]
                                    [--phases 4] [--exact-s S] [--copies] [--memsets]
                                    [--out bench/results/sampling_error.json]

``--exact-s S``: every launch counted for the first S seconds, sampling after, as
``--gpu-sample auto`` switches. ``--copies``: the host-to-device and device-to-device
copies and the syncs are switched with the launch probes, as ``--gpu-sample auto`` does
where the other probes tell a thread's steps apart without them (``copies_blind_error``
in the output: how far off launches estimated without them were, per step thread, on
the truth's steps); a burst a sync flushed then ends at its result copy instead, where
the sync's wait began (``reason`` "copy"), or not at all: it goes on into the next
burst of its thread, as the kernel sums them. ``--memsets``: the memsets
too, as auto does where their bytes so estimated were within 10%, or their error within
1% of the bytes moved (``memsets_blind_bytes_error``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracer.correlate.connections import TrackerOptions  # noqa: E402
from tracer.correlate.records import RequestRecord  # noqa: E402
from tracer.correlate.sampling import RUN_LENGTHS  # noqa: E402
from tracer.events import capture, schema  # noqa: E402
from tracer.events.gpu import SAMPLED_COPY_KINDS, GpuSampling, KernelBurst  # noqa: E402
from tracer.pipeline import Pipeline  # noqa: E402

DEFAULT_CAPTURES = [ROOT / "samples/captures/hf-cb-c32-h100.ttcap",
                    ROOT / "samples/captures/hf-serve-cb-h100.ttcap",
                    ROOT / "samples/captures/hf-plain-c4-h100.ttcap"]
KBURST_KIND = schema.wire.CONSTANTS["KIND_KBURST"].to_bytes(4, "little")


def load(path: Path) -> tuple[list[Any], dict[str, Any]]:
    """A capture's items (GPU bursts decoded, the rest as recorded) and its header."""
    reader = capture.CaptureReader(path)
    items: list[Any] = []
    for item in reader:
        if isinstance(item, bytes) and item[:4] == KBURST_KIND:
            item = schema.decode(item)
        items.append(item)
    return items, reader.header


def impose(items: list[Any], fraction: float, period_ns: int, phase_ns: int,
           exact_ns: int = 0, copies: bool = False, memsets: bool = False) -> list[Any]:
    """``items`` as ``--gpu-sample fraction`` with this period would have recorded them:
    launch probes on for the first ``fraction`` of each period (periods start
    ``phase_ns`` before the first burst, or ``exact_ns`` after it: every launch counted
    until then, as ``--gpu-sample auto`` does), switches sent before the first burst
    after them, bursts not wholly inside an "on" window without launches (and, with
    ``copies``, without the SAMPLED_COPY_KINDS copies, with ``memsets`` without their
    memsets: switched with the launches)."""
    bursts = [i for i in items if isinstance(i, KernelBurst)]
    if not bursts:
        return list(items)
    start = min(b.first_ts for b in bursts) + exact_ns - phase_ns
    on_ns = int(fraction * period_ns)

    def window(ts: int) -> int:
        return (ts - start) // period_ns

    def on(ts: int) -> bool:
        return (ts - start) % period_ns < on_ns

    switches: list[tuple[int, bool]] = []
    t, end = start, max(b.last_ts for b in bursts)
    while t <= end:
        switches += [(t, True), (t + on_ns, False)]
        t += period_ns
    out: list[Any] = []
    k = 0
    held: dict[tuple[int, int], KernelBurst] = {}  # a burst the syncs' probes would not end
    for item in items:
        if isinstance(item, KernelBurst):
            while k < len(switches) and switches[k][0] <= item.last_ts:
                ts, enabled = switches[k]
                out.append(GpuSampling(ts=ts, enabled=enabled, fraction=fraction,
                                       copies=copies, memsets=memsets))
                k += 1
            # the probes were on all along before ``start`` (every launch counted) and
            # stay on into the first window: a burst across ``start`` is whole too
            first = max(item.first_ts, start)
            whole = item.last_ts < start or (window(first) == window(item.last_ts)
                                             and on(first) and on(item.last_ts))
            if not whole:
                item = replace(item, launches=0, graph_launches=0, handle_counts={})
            if not whole and memsets:
                item = replace(item, memset_calls=0, memset_bytes=0)
            if not whole and copies:  # the copies and the syncs switched with the launches
                item = replace(item, copy_bytes={k: 0 if k in SAMPLED_COPY_KINDS else n
                                                 for k, n in item.copy_bytes.items()},
                               copy_calls={k: 0 if k in SAMPLED_COPY_KINDS else n
                                           for k, n in item.copy_calls.items()},
                               sync_calls=0, sync_wait_ns=0, sync_api=0,
                               last_ts=item.last_ts - item.sync_wait_ns)
                key = (item.pid, item.tid)
                if key in held:
                    item = _merged(held.pop(key), item)
                if item.reason == "sync":
                    # no sync seen: the result copy flushes its burst, where the sync's
                    # wait began; a sync inside a step flushes nothing, so its burst
                    # goes on into the next
                    if not item.copy_calls.get("d2h", 0):
                        held[key] = replace(item, reason="interval")
                        continue
                    item = replace(item, reason="copy")
            elif (item.pid, item.tid) in held:  # the probes came on: it was flushed
                out.append(held.pop((item.pid, item.tid)))
        out.append(item)
    return out + list(held.values())


def _merged(a: KernelBurst, b: KernelBurst) -> KernelBurst:
    """Bursts ``a`` and then ``b`` of one thread as the kernel would have summed them
    (no sync between them flushed: the syncs' probes were off)."""
    kinds = set(a.copy_bytes) | set(b.copy_bytes)
    handles = dict(a.handle_counts)
    for h, n in b.handle_counts.items():
        handles[h] = handles.get(h, 0) + n
    return replace(
        b, first_ts=a.first_ts, launches=a.launches + b.launches,
        graph_launches=a.graph_launches + b.graph_launches,
        copy_bytes={k: a.copy_bytes.get(k, 0) + b.copy_bytes.get(k, 0) for k in kinds},
        copy_calls={k: a.copy_calls.get(k, 0) + b.copy_calls.get(k, 0) for k in kinds},
        memset_bytes=a.memset_bytes + b.memset_bytes,
        memset_calls=a.memset_calls + b.memset_calls,
        query_polls=a.query_polls + b.query_polls, handle_counts=handles)


class Collect:
    """A record sink keeping each request's charged launches and GPU time."""

    def __init__(self) -> None:
        self.gpu: dict[tuple[int, int, int, int], dict[str, Any]] = {}

    def on_record(self, rec: RequestRecord) -> None:
        self.gpu[rec.key] = dict(rec.gpu)

    def close(self) -> None:
        pass


def replay(items: Iterable[Any], header: dict[str, Any]) -> tuple[Collect, Pipeline]:
    sink = Collect()
    p = Pipeline([sink], options=TrackerOptions(
        tenant_salt=capture.tenant_salt(header),
        secrets_masked=header.get("secrets_masked") is True))
    for item in items:
        p.feed(item)
    p.close()
    return sink, p


def errors(truth: Collect, sampled: Collect, key: str, scale: float = 1.0) -> dict[str, Any]:
    """Per request |sampled - truth| / truth for one attribute, and the totals' ratio."""
    rel = []
    t_sum = s_sum = 0.0
    for k, t in truth.gpu.items():
        tv = float(t.get(key, 0.0)) * scale
        sv = float(sampled.gpu.get(k, {}).get(key, 0.0)) * scale
        t_sum += tv
        s_sum += sv
        if tv > 0:
            rel.append(abs(sv - tv) / tv)
    rel.sort()
    return {"total_ratio": round(s_sum / t_sum, 4) if t_sum else None,
            "requests": len(rel),
            "median_error": round(statistics.median(rel), 4) if rel else None,
            "p90_error": round(rel[int(0.9 * (len(rel) - 1))], 4) if rel else None,
            "max_error": round(rel[-1], 4) if rel else None}


def measure(path: Path, fraction: float, period_s: float, phases: int,
            exact_s: float = 0.0, copies: bool = False, memsets: bool = False
            ) -> dict[str, Any]:
    items, header = load(path)
    truth, tp = replay(items, header)
    assert tp.attribution.ledger.balanced()
    runs = []
    period_ns = int(period_s * 1e9)
    for i in range(phases):
        phase = period_ns * i // phases
        sampled, sp = replay(impose(items, fraction, period_ns, phase, int(exact_s * 1e9),
                                    copies, memsets), header)
        stats = sp.stats
        recon = sp.attribution.ledger
        runs.append({
            "phase_s": round(phase / 1e9, 3),
            "balanced": recon.balanced(),
            "steps_counted": stats["gpu_steps_counted"],
            "steps_estimated": stats["gpu_steps_estimated"],
            "steps_unestimated": stats["gpu_steps_unestimated"],
            "kernel_launches": errors(truth, sampled, "gpu.kernel_launches"),
            "gpu_time": errors(truth, sampled, "gpu.time_ms"),
            **{f"memcpy_bytes_{k}": errors(truth, sampled, f"gpu.memcpy_bytes.{k}")
               for k in SAMPLED_COPY_KINDS},
            "memset_bytes": errors(truth, sampled, "gpu.memset_bytes"),
        })
    est = tp.attribution.estimates
    steps = tp.attribution.typical_request_steps()
    return {"capture": path.name, "requests": len(truth.gpu), "fraction": fraction,
            "period_s": period_s, "exact_s": exact_s, "copies": copies, "memsets": memsets,
            # how far launches estimated without the sampled copies were off,
            # per step thread, over the truth's steps (what --gpu-sample auto decides by)
            "copies_blind_error": {f"{pid}/{tid}": round(e, 4) for (pid, tid) in est.blind
                                   if (e := est.blind_error(pid, tid)) is not None},
            # and how far the copies' own bytes so estimated were (the worst kind)
            "copies_blind_bytes_error": {f"{pid}/{tid}": round(e, 4) for (pid, tid) in est.blind
                                         if (e := est.blind_copy_error(pid, tid)) is not None},
            # and the memsets' bytes (what decides whether auto switches them)
            "memsets_blind_bytes_error": {
                f"{pid}/{tid}": round(e, 4) for (pid, tid) in est.blind
                if (e := est.blind_memset_error(pid, tid)) is not None},
            # ... the same summed over runs of each RUN_LENGTHS steps, the steps the
            # median request was in, and whether auto would keep the memsets probed
            "memsets_blind_runs_error": {
                f"{pid}/{tid}": {n: round(off / nbytes, 4) for n, (off, nbytes)
                                 in zip(RUN_LENGTHS, runs) if nbytes}
                for (pid, tid), runs in est.blind_memset_runs.items()},
            "request_steps_median": steps,
            "memsets_kept_probed": {f"{pid}/{tid}": est.memsets_tell_steps_apart(pid, tid, steps)
                                    for (pid, tid) in est.blind},
            "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("captures", nargs="*", type=Path, default=DEFAULT_CAPTURES)
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--period-s", type=float, default=1.0)
    ap.add_argument("--phases", type=int, default=4, help="sampling phases per capture")
    ap.add_argument("--exact-s", type=float, default=0.0, metavar="S",
                    help="every launch counted for the first S seconds (--gpu-sample auto)")
    ap.add_argument("--copies", action="store_true",
                    help="the host-to-device and device-to-device copies switched with "
                         "the launch probes")
    ap.add_argument("--memsets", action="store_true",
                    help="the memsets switched with the launch probes")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    doc = {"bench": "sampling_error", "results": [
        measure(p, args.fraction, args.period_s, args.phases, args.exact_s, args.copies,
                args.memsets)
        for p in args.captures]}
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
