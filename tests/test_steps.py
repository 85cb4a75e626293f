"""Continuous batching from the outside: engine steps shared among the requests whose
streamed tokens show they were in them, across threads and linked processes."""

from __future__ import annotations

from collections import Counter

from protocols.openai import LLMResponse
from tracer.correlate.attribution import GpuAttribution
from tracer.correlate.ipc import IpcGraph
from tracer.correlate.records import RequestRecord
from tracer.correlate.membership import request_range
from tracer.correlate.steps import StepLog
from tests.test_attribution import burst

ENGINE = 99


def streamed(pid: int, fd: int, arrival: int, token_ts: list[int]) -> RequestRecord:
    r = LLMResponse(status=200, streamed=True, output_tokens=len(token_ts),
                    first_token_ts=token_ts[0], token_ts=list(token_ts))
    return RequestRecord(pid=pid, fd=fd, conn_id=fd, exchange=0, role="server", tids=[1],
                         start_ns=arrival, request_end_ns=arrival, end_ns=token_ts[-1] + 1,
                         llm_response=r)


class World:
    """An engine thread running steps k = 0.. at [100k + 10, 100k + 90], launching
    10 + k kernels each, and requests whose tokens are written ``lag`` after the step
    that made them (the API thread's hand-off)."""

    def __init__(self, membership: dict[str, tuple[int, int, int]], lags: dict[str, list[int]],
                 engine_pid: int = 1, api_pid: int = 1) -> None:
        self.stats: Counter[str] = Counter()
        self.out: list[RequestRecord] = []
        self.ipc = IpcGraph(self.stats)
        self.a = GpuAttribution(self.out.append, lambda pid: [], self.stats, hold_ns=1000,
                                ipc=self.ipc)
        self.membership = membership
        steps = max(last for _, _, last in membership.values()) + 2
        self.recs = {}
        for fd, (name, (arrival, first, last)) in enumerate(membership.items(), start=10):
            lag = lags.get(name, [5] * (last - first + 1))
            toks = [100 * k + 90 + lag[i] for i, k in enumerate(range(first, last + 1))]
            self.recs[name] = streamed(api_pid, fd, arrival, toks)
        for k in range(steps):
            self.a.burst(burst(engine_pid, ENGINE, 100 * k + 10, 100 * k + 90, 10 + k))
        for rec in sorted(self.recs.values(), key=lambda r: r.end_ns):
            self.a.finished(rec)
        self.a.close()

    def truth(self, name: str) -> float:
        _, first, last = self.membership[name]
        total = 0.0
        for k in range(first, last + 1):
            n = sum(1 for _, f, la in self.membership.values() if f <= k <= la)
            total += (10 + k) / n
        return total


def test_steps_are_shared_among_the_requests_in_them_and_queued_ones_pay_nothing():
    # a: steps 0-4; b: arrives during step 1, in steps 2-7; c: arrives at 5 but waits
    # (queued) until step 5, in 5-6
    membership = {"a": (0, 0, 4), "b": (150, 2, 7), "c": (5, 5, 6)}
    # one of b's tokens is written late, after the next step had ended
    w = World(membership, {"b": [5, 5, 130, 5, 5, 5]})
    for name, rec in w.recs.items():
        assert rec.gpu["gpu.kernel_launches"] == round(w.truth(name), 3), name
        # 8 steps at the stream's end: a provisional model fitted on them (it finds the
        # members alike, as they are)
        assert rec.gpu["gpu.attribution"] == "step_model"
        assert rec.gpu["gpu.steps"] == len(rec.llm_response.token_ts)
    c = w.recs["c"].gpu
    assert c["gpu.prefill_launches"] == round(15 / 2, 3)  # its first step, shared with b
    assert w.stats["gpu_steps"] == 9
    assert w.stats["gpu_steps_unattributed"] == 1  # the last step served nobody
    phases = {ch.name: ch for ch in w.recs["c"].children}
    assert phases["queue"].start_ns == 5 and phases["queue"].end_ns == 510
    assert phases["prefill"].start_ns == 510 and phases["decode"].end_ns == 695


def test_gpu_time_is_the_step_span_shared_like_launches():
    w = World({"a": (0, 0, 1), "b": (0, 1, 1)}, {})
    # step span 80 ns: a has step 0 alone and half of step 1
    assert w.recs["a"].gpu["gpu.time_ms"] == round(120 / 1e6, 4)
    assert w.recs["a"].gpu["gpu.time_method"] == "step_span"


def test_engine_in_another_process_is_joined_through_the_ipc_graph():
    membership = {"a": (0, 0, 2), "b": (0, 1, 3)}
    unlinked = World(membership, {}, engine_pid=7, api_pid=1)
    assert all(r.gpu == {} for r in unlinked.recs.values())

    stats: Counter[str] = Counter()
    ipc = IpcGraph(stats)
    msg = b'\x00\x00\x00\x50{"type": "submit", "id": "cmpl-0123456789abcdef", "prompt_ids": [1]}'
    ipc.data(1, 9, 1, False, msg, 100)  # the API process writes
    ipc.data(7, 4, 2, True, msg[:4], 120)  # the engine reads it in two parts
    ipc.data(7, 4, 2, True, msg[4:], 121)
    assert ipc.serving_group(1) == {1, 7} and ipc.edges() == [(1, 7, ["payload"])]

    out: list[RequestRecord] = []
    a = GpuAttribution(out.append, lambda pid: [], Counter(), hold_ns=1000, ipc=ipc)
    recs = [streamed(1, 10, 0, [95, 195, 295]), streamed(1, 11, 100, [195, 295, 395])]
    for k in range(5):
        a.burst(burst(7, ENGINE, 100 * k + 10, 100 * k + 90, 10 + k))
    for r in recs:
        a.finished(r)
    a.close()
    assert recs[0].gpu["gpu.kernel_launches"] == round(10 + 11 / 2 + 12 / 2, 3)
    assert recs[1].gpu["gpu.kernel_launches"] == round(11 / 2 + 12 / 2 + 13, 3)


def test_loopback_tcp_ends_are_linked_by_address():
    ipc = IpcGraph()
    ipc.connection(1, ("127.0.0.1", 40000), ("127.0.0.1", 9000))
    ipc.connection(2, ("127.0.0.1", 9000), ("127.0.0.1", 40000))
    ipc.connection(3, ("127.0.0.1", 9001), ("127.0.0.1", 40001))
    assert ipc.serving_group(2) == {1, 2} and ipc.serving_group(3) == {3}


def test_different_bytes_or_distant_times_do_not_link():
    ipc = IpcGraph()
    ipc.data(1, 9, 1, False, b"x" * 64, 100)
    ipc.data(2, 9, 1, True, b"y" * 64, 100)
    ipc.data(3, 9, 1, True, b"x" * 64, 100 + 3 * 10**9)
    ipc.data(1, 8, 1, True, b"x" * 64, 100)  # its own bytes
    assert ipc.graph.number_of_edges() == 0


def test_a_reader_that_missed_the_start_still_links():
    """Blocked in recv(4) when the tracer attached, the reader never shows the length
    prefix: its first bytes are found inside what the writer was seen writing."""
    ipc = IpcGraph()
    msg = b"\x00\x00\x01\x6d" + b'{"step": 1, "members": [{"id": "cmpl-7b12d8e0f1514c32"}]}'
    ipc.data(5, 4, 1, True, msg[4:], 130)  # the reader's event may come first
    ipc.data(4, 5, 1, False, msg, 120)
    assert ipc.edges() == [(4, 5, ["payload"])]


def test_a_long_prompt_is_charged_its_prefill_steps_when_a_slot_was_free():
    """Chunked prefill: b arrives before step 1 and shows its first token only after
    step 4; steps 1-3 had a free slot (a ran alone; two ran at once later), so b was
    prefilling in them. c arrives while a and b fill both slots: queued until step 6."""
    membership = {"a": (0, 0, 5), "b": (50, 4, 6), "c": (350, 6, 7)}
    w = World(membership, {})
    b, c = w.recs["b"].gpu, w.recs["c"].gpu
    assert b["gpu.kernel_launches"] == round((11 + 12 + 13 + 14 + 15 + 16) / 2, 3)
    assert b["gpu.steps"] == 6 and b["gpu.prefill_launches"] == round((11 + 12 + 13 + 14) / 2, 3)
    assert c["gpu.steps"] == 2 and c["gpu.kernel_launches"] == round(16 / 2 + 17, 3)
    phases = {ch.name: ch for ch in w.recs["b"].children}
    assert phases["prefill"].attributes["tokentrace.gpu.steps"] == 4


def span(occ):
    return (occ.first, occ.last, occ.how)


def test_request_range_bounds():
    log = StepLog(1, ENGINE)
    for k in range(6):
        log.add_burst(burst(1, ENGINE, 100 * k + 10, 100 * k + 90, 1))
    assert log.last_ended_by(89) == -1 and log.last_ended_by(90) == 0
    assert log.first_started_after(11) == 1
    # tokens after steps 2, 3, 4; the second written two steps late
    rec = streamed(1, 10, 0, [295, 595, 495])
    assert span(request_range(rec, log)) == (2, 4, "tokens")
    # not streamed: 3 tokens, answered after step 4
    whole = RequestRecord(pid=1, fd=11, conn_id=11, exchange=0, role="server",
                          start_ns=0, end_ns=499, response_start_ns=495,
                          llm_response=LLMResponse(status=200, output_tokens=3))
    assert span(request_range(whole, log)) == (2, 4, "response")
    # tokens faster than the steps after its arrival: never before arrival
    early = streamed(1, 12, 250, [295, 395])
    assert span(request_range(early, log)) == (3, 3, "tokens_clamped")


def nccl(pid: int, op: str, ts: int, comm: int = 0xC0, comm_id: int = 0xABC, rank: int = 0,
         count: int = 256):
    from tracer.events.gpu import NcclEvent
    return NcclEvent(pid=pid, tid=ENGINE, op=op, dtype=7, ts_enter=ts, ts_exit=ts + 1,
                     count=count, comm=comm, stream=0, comm_id=comm_id, peer=rank, nranks=2,
                     ret=0)


def test_tensor_parallel_rank_steps_join_rank_zero_through_collectives():
    """Rank 1's steps end after the tokens are written (its work trails rank 0's), so
    aligning it by itself would be off by one; and the tracer attached when rank 1 had
    already issued one more collective than rank 0. Matching the two ranks'
    collective sequences (op, count, type) joins them step by step."""
    ipc = IpcGraph()
    ipc.link(1, 7, "test")
    ipc.link(7, 8, "test")
    out: list[RequestRecord] = []
    stats: Counter[str] = Counter()
    a = GpuAttribution(out.append, lambda pid: [], stats, hold_ns=1000, ipc=ipc)
    a.nccl(nccl(8, "allreduce", 5, comm=0xD0, count=999))  # rank 1's step before attach
    a.burst(burst(8, ENGINE, 6, 8, 1))
    counts = [256, 512, 512, 768]
    for k in range(4):
        a.nccl(nccl(7, "allreduce", 100 * k + 20, count=counts[k]))
        a.burst(burst(7, ENGINE, 100 * k + 10, 100 * k + 90, 10))
        a.nccl(nccl(8, "allreduce", 100 * k + 25, comm=0xD0, count=counts[k]))
        a.burst(burst(8, ENGINE, 100 * k + 15, 100 * k + 99, 1 + k))  # ends after the token
    recs = [streamed(1, 10, 0, [95, 195]), streamed(1, 11, 100, [195, 295, 395])]
    for r in recs:
        a.finished(r)
    a.close()
    # rank 0: a has step 0 alone, shares step 1; rank 1 likewise, joined step by step
    assert recs[0].gpu["gpu.kernel_launches"] == round(10 + 5 + 1 + 2 / 2, 3)
    assert recs[1].gpu["gpu.kernel_launches"] == round(5 + 10 + 10 + 2 / 2 + 3 + 4, 3)
    assert recs[0].gpu["gpu.nccl_bytes"] == 4 * (256 + 512 / 2 + 256 + 512 / 2)
    assert recs[0].gpu["gpu.steps"] == 2  # rank 1's steps are the same steps
    assert stats["gpu_steps_joined_nccl"] == 4 and stats["gpu_steps_unjoined"] == 0
    assert a.ledger.balanced()
