"""GPU bursts to requests: same thread, then same process by time order (issue 4, first
slice).

``GpuAttribution`` is fed in stream order with ``KernelBurst``s and with finished
``RequestRecord``s. A burst of process P is shared among P's requests in flight over
the burst's ``[first_ts, last_ts]``: those still open in the connection tracker that
started by ``last_ts``, and those already finished whose ``end_ns`` is not before
``first_ts``. If exactly one of them was served on the burst's thread, it takes the
burst whole ("same_thread"); otherwise each takes an equal share ("time_share").

A finished record is held, not emitted, until its process's bursts up to its end have
arrived: until a burst of that process starting after its ``end_ns`` is seen, the
stream's clock passes ``end_ns + hold_ns``, or the stream ends. A burst that arrives
after a record it overlapped was released is counted in ``gpu_bursts_late``.

Not yet here: HTTP/2 (gRPC) calls, requests in other processes (IPC), and continuous
batching's per-step sharing (DESIGN.md, "Correlation").
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable

from tracer.correlate.records import RequestRecord
from tracer.events.gpu import COPY_KINDS, KernelBurst

Key = tuple[int, int, int, int]
DEFAULT_HOLD_NS = 50_000_000  # > the probes' default burst flush interval (10 ms)


@dataclass
class GpuShare:
    """What one request was charged: sums of its (shares of) bursts."""

    kernel_launches: float = 0.0
    graph_launches: float = 0.0
    memcpy_bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COPY_KINDS, 0.0))
    sync_wait_ns: float = 0.0
    bursts: int = 0
    whole: bool = True  # every burst it was charged it had alone
    same_thread: bool = True  # every burst it was charged was attributed by thread

    def add(self, b: KernelBurst, fraction: float, same_thread: bool) -> None:
        """Charge ``fraction`` of burst ``b``."""
        self.bursts += 1
        self.kernel_launches += b.launches * fraction
        self.graph_launches += b.graph_launches * fraction
        for k in COPY_KINDS:
            self.memcpy_bytes[k] += b.copy_bytes.get(k, 0) * fraction
        self.sync_wait_ns += b.sync_wait_ns * fraction
        self.whole = self.whole and fraction == 1.0
        self.same_thread = self.same_thread and same_thread

    def attributes(self) -> dict[str, object]:
        """Attribute name suffixes (``tokentrace.<suffix>`` on the span) -> values."""

        def count(x: float) -> float | int:
            return round(x) if self.whole else round(x, 3)

        out: dict[str, object] = {
            "gpu.kernel_launches": count(self.kernel_launches),
            "gpu.graph_launches": count(self.graph_launches),
            "gpu.sync_wait_ms": round(self.sync_wait_ns / 1e6, 3),
            "gpu.bursts": self.bursts,
            "gpu.attribution": "same_thread" if self.same_thread else "time_share",
        }
        for k in COPY_KINDS:
            if self.memcpy_bytes[k]:
                out[f"gpu.memcpy_bytes.{k}"] = count(self.memcpy_bytes[k])
        return out


class GpuAttribution:
    """Shares bursts among the requests in flight and holds records until they are due."""

    def __init__(self, emit: Callable[[RequestRecord], None],
                 open_records: Callable[[int], Iterable[RequestRecord]],
                 stats: Counter[str] | None = None, hold_ns: int = DEFAULT_HOLD_NS) -> None:
        self.emit = emit
        self.open_records = open_records
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self.hold_ns = hold_ns
        self.held: dict[int, list[RequestRecord]] = {}
        self.shares: dict[Key, GpuShare] = {}
        self.released: dict[int, int] = {}  # pid -> latest end_ns of a released record
        self.gpu_pids: set[int] = set()  # processes seen launching on the GPU

    def burst(self, b: KernelBurst) -> None:
        """Charge one burst to its process's requests in flight, then release the
        records it proves complete."""
        self.stats["gpu_bursts"] += 1
        self.gpu_pids.add(b.pid)
        held = self.held.get(b.pid, [])
        sharers = [r for r in self.open_records(b.pid) if r.start_ns <= b.last_ts]
        sharers += [r for r in held if r.start_ns <= b.last_ts and r.end_ns >= b.first_ts]
        if self.released.get(b.pid, -1) >= b.first_ts:
            self.stats["gpu_bursts_late"] += 1
        if not sharers:
            self.stats["gpu_bursts_unattributed"] += 1
        else:
            same = [r for r in sharers if b.tid in r.tids]
            if len(same) == 1:
                self._share(same[0]).add(b, 1.0, True)
                self.stats["gpu_bursts_same_thread"] += 1
            else:
                for r in sharers:
                    self._share(r).add(b, 1.0 / len(sharers), False)
                self.stats["gpu_bursts_time_share"] += 1
        self._release(b.pid, lambda r: r.end_ns < b.first_ts)

    def finished(self, rec: RequestRecord) -> None:
        """A finished record: held until its bursts can no longer arrive (emitted at
        once if its process has not been seen on the GPU)."""
        self.held.setdefault(rec.pid, []).append(rec)
        if rec.pid not in self.gpu_pids:
            self._release(rec.pid, lambda r: True)

    def advance(self, now_ns: int) -> None:
        """The stream's clock: release records that ended more than ``hold_ns`` ago."""
        for pid in list(self.held):
            self._release(pid, lambda r: r.end_ns + self.hold_ns <= now_ns)

    def close(self) -> None:
        """End of the stream: release everything held, in end order."""
        for pid in list(self.held):
            self._release(pid, lambda r: True)

    def _share(self, rec: RequestRecord) -> GpuShare:
        s = self.shares.get(rec.key)
        if s is None:
            s = self.shares[rec.key] = GpuShare()
        return s

    def _release(self, pid: int, due: Callable[[RequestRecord], bool]) -> None:
        held = self.held.get(pid)
        if not held:
            return
        keep = []
        for rec in sorted(held, key=lambda r: r.end_ns):
            if not due(rec):
                keep.append(rec)
                continue
            share = self.shares.pop(rec.key, None)
            if share is not None:
                rec.gpu.update(share.attributes())
            self.released[pid] = max(self.released.get(pid, 0), rec.end_ns)
            self.emit(rec)
        if keep:
            self.held[pid] = keep
        else:
            del self.held[pid]
