"""tracer/correlate/arrivals.py: the open record that arrived first, per process."""

from __future__ import annotations

import random

from tracer.correlate.arrivals import SWEEP_MIN, Arrivals
from tracer.correlate.membership import arrival_ns
from tracer.correlate.records import RequestRecord


def rec(pid: int, ex: int, start: int) -> RequestRecord:
    return RequestRecord(pid=pid, fd=3, conn_id=1, exchange=ex, role="server",
                         start_ns=start)


def test_the_earliest_open_record_is_found_as_records_open_arrive_and_finish():
    rng = random.Random(5)
    open_: set[int] = set()
    live: list[RequestRecord] = []
    idx = Arrivals(lambda r: id(r) in open_, lambda pid: [r for r in live if r.pid == pid])
    for n in range(5000):
        r = rec(1 + n % 3, n, n * 10 + rng.randint(0, 40))
        open_.add(id(r))
        live.append(r)
        idx.add(r)
        for r2 in rng.sample(live, min(len(live), 2)):
            if rng.random() < 0.3 and not r2.request_end_ns:  # its last byte read
                r2.request_end_ns = r2.start_ns + rng.randint(0, 3000)
            if rng.random() < 0.45:  # finished
                open_.discard(id(r2))
                live.remove(r2)
        for pid in (1, 2):
            mine = [r2 for r2 in live if r2.pid == pid]
            want = min((arrival_ns(r2) for r2 in mine), default=None)
            got = idx.earliest(pid)
            assert (None if got is None else arrival_ns(got)) == want
    # finished records deep in a heap are swept: it stays near what is open
    assert all(len(h) <= max(SWEEP_MIN, 4 * len(live)) + 1 for h in idx.heaps.values())
    # a process never asked about (here 3) keeps no record here; the first question
    # finds its open records all the same
    assert 3 not in idx.heaps
    mine = [r2 for r2 in live if r2.pid == 3]
    got = idx.earliest(3)
    assert (got is None and not mine) or arrival_ns(got) == min(map(arrival_ns, mine))
    idx.forget(3)
    assert 3 not in idx.heaps
