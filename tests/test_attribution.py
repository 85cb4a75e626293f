"""GpuAttribution's rules on hand-made streams: same thread takes a burst whole, other
threads share it equally by time, and records wait for their bursts."""

from __future__ import annotations

from collections import Counter

from tracer.correlate.attribution import GpuAttribution
from tracer.correlate.records import RequestRecord
from tracer.events.gpu import KernelBurst


def burst(pid: int, tid: int, first: int, last: int, launches: int, h2d: int = 0,
          wait_ns: int = 0) -> KernelBurst:
    return KernelBurst(pid=pid, tid=tid, reason="sync", sync_api=0, first_ts=first,
                       last_ts=last, launches=launches, graph_launches=0,
                       copy_bytes={"h2d": h2d, "d2h": 0, "d2d": 0, "other": 0},
                       copy_calls={}, memset_bytes=0, memset_calls=0, sync_calls=1,
                       sync_wait_ns=wait_ns, query_polls=0, handle_counts={})


def rec(pid: int, fd: int, tid: int, start: int, end: int) -> RequestRecord:
    return RequestRecord(pid=pid, fd=fd, conn_id=fd, exchange=0, role="server",
                         tids=[tid], start_ns=start, end_ns=end)


class Harness:
    def __init__(self, hold_ns: int = 1000) -> None:
        self.open: list[RequestRecord] = []
        self.out: list[RequestRecord] = []
        self.stats: Counter[str] = Counter()
        self.a = GpuAttribution(self.out.append,
                                lambda pid: [r for r in self.open if r.pid == pid],
                                self.stats, hold_ns)

    def finish(self, r: RequestRecord) -> None:
        self.open.remove(r)
        self.a.finished(r)


def test_same_thread_takes_the_burst_whole_others_share_by_time():
    h = Harness()
    a, b = rec(1, 5, 10, 0, 100), rec(1, 6, 11, 0, 100)
    h.open += [a, b]
    h.a.burst(burst(1, 10, 10, 20, 7, h2d=64, wait_ns=3_000_000))  # a's thread
    h.a.burst(burst(1, 99, 30, 40, 3))  # an engine thread: shared
    h.a.burst(burst(2, 99, 30, 40, 50))  # another process: neither
    h.finish(a)
    h.finish(b)
    h.a.close()
    got = {r.fd: r.gpu for r in h.out}
    assert got[5]["gpu.kernel_launches"] == 8.5 and got[6]["gpu.kernel_launches"] == 1.5
    assert got[5]["gpu.attribution"] == "time_share"
    assert got[5]["gpu.memcpy_bytes.h2d"] == 64 and "gpu.memcpy_bytes.h2d" not in got[6]
    assert got[5]["gpu.sync_wait_ms"] == 3.0
    assert h.stats["gpu_steps_unattributed"] == 1 and h.stats["gpu_launches_unattributed"] == 50


def test_a_lone_request_gets_whole_counts_and_same_thread():
    h = Harness()
    a = rec(1, 5, 10, 0, 100)
    h.open.append(a)
    h.a.burst(burst(1, 10, 10, 20, 4))
    h.a.burst(burst(1, 77, 30, 40, 2))  # other thread, but a is the only one in flight
    h.finish(a)
    h.a.close()
    assert h.out[0].gpu["gpu.kernel_launches"] == 6
    assert isinstance(h.out[0].gpu["gpu.kernel_launches"], int)
    assert h.out[0].gpu["gpu.attribution"] == "time_share"  # the second burst was by time


def test_records_of_processes_without_gpu_work_are_not_held():
    h = Harness()
    a = rec(3, 5, 10, 0, 100)
    h.a.finished(a)
    assert h.out == [a] and a.gpu == {}


def test_records_wait_for_bursts_up_to_their_end():
    h = Harness(hold_ns=1000)
    a = rec(1, 5, 10, 0, 100)
    h.open.append(a)
    h.a.burst(burst(1, 10, 5, 6, 2))
    h.finish(a)
    h.a.advance(500)
    assert h.out == []  # held: a burst from before its end may still come
    h.a.burst(burst(1, 10, 90, 150, 5))  # overlaps a's end: a's
    assert h.out == []
    h.a.burst(burst(1, 10, 200, 210, 5))  # after a's end: releases it, not charged
    assert [r.gpu["gpu.kernel_launches"] for r in h.out] == [7]
    b = rec(1, 6, 10, 300, 400)
    h.a.finished(b)
    h.a.advance(1399)
    assert len(h.out) == 1
    h.a.advance(1400)  # the clock passed end + hold
    assert len(h.out) == 2 and h.out[1].gpu == {}
    h.a.burst(burst(1, 10, 350, 360, 1))  # too late for b
    assert h.stats["gpu_bursts_late"] == 1
