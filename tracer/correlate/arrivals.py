"""Each process's requests still being assembled, by arrival: the first one cheaply.

The GPU attribution settles a step once no request that may have been in it is still
open, which it asks as "the open request of this process that arrived first" each
time the last one it was told finishes: about once per request finished. A scan of
every open exchange would make that quadratic in the requests in flight, so records
go on a heap as they open, keyed by their arrival (``membership.arrival_ns``), and
are taken off lazily: a finished one when it comes to the top, one whose arrival
moved (a request's arrival is its last byte's read, later than its first) put back
under its new key. Finished records deeper in a heap are swept out once it has grown
to several times what was open at the last sweep. Only processes asked about have a
heap (seeded from what is open when first asked): a process that never ran GPU work
keeps no finished record alive here.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterable

from tracer.correlate.membership import arrival_ns
from tracer.correlate.records import RequestRecord

SWEEP_MIN = 256  # a heap shorter than this is never swept


class Arrivals:
    """``add`` each record as it opens; ``earliest(pid)``: the open one that arrived
    first (``is_open`` says which still are; ``scan(pid)``: the open ones now, read
    once per process, when it is first asked about)."""

    def __init__(self, is_open: Callable[[RequestRecord], bool],
                 scan: Callable[[int], Iterable[RequestRecord]]) -> None:
        self.is_open = is_open
        self.scan = scan
        self.heaps: dict[int, list[tuple[int, int, RequestRecord]]] = {}
        self._sweep_at: dict[int, int] = {}
        self._seq = itertools.count()

    def add(self, rec: RequestRecord) -> None:
        heap = self.heaps.get(rec.pid)
        if heap is None:
            return  # not asked about (yet): the scan will find it
        heapq.heappush(heap, (arrival_ns(rec), next(self._seq), rec))
        if len(heap) >= self._sweep_at.get(rec.pid, SWEEP_MIN):
            self._sweep(rec.pid, heap)

    def _sweep(self, pid: int, heap: list[tuple[int, int, RequestRecord]]) -> None:
        heap[:] = [e for e in heap if self.is_open(e[2])]
        heapq.heapify(heap)
        self._sweep_at[pid] = max(SWEEP_MIN, 4 * len(heap))

    def earliest(self, pid: int) -> RequestRecord | None:
        heap = self.heaps.get(pid)
        if heap is None:
            heap = self.heaps[pid] = [(arrival_ns(r), next(self._seq), r)
                                      for r in self.scan(pid)]
            heapq.heapify(heap)
        while heap:
            key, seq, rec = heap[0]
            if not self.is_open(rec):
                heapq.heappop(heap)
                continue
            now = arrival_ns(rec)
            if now != key:  # its arrival moved on since: put back where it now belongs
                heapq.heapreplace(heap, (now, seq, rec))
                continue
            return rec
        return None

    def forget(self, pid: int) -> None:
        """Process ``pid`` is gone."""
        self.heaps.pop(pid, None)
        self._sweep_at.pop(pid, None)
