"""Token runs without a kernel: RUN records taken as the DATA records they replace.

The traffic is bench/streamgen.py's OpenAI streams (whose tokens include quotes, a
backslash and non-ASCII text, escaped by json.dumps), and ``stage_runs`` turns it into
what the kernel sends with token runs (bpf/sockets.c). The real probes are tested on
real servers in tests/test_live_runs.py.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from bench.streamgen import _plain_string, generate, stage_runs
from protocols.openai import _JSON_STRING_BYTES
from tests.live import Collected
from tracer.correlate.connections import TrackerOptions
from tracer.correlate.tokenruns import (ARMS_KEPT, MAX_ASKS, REARM_AFTER_NS, TokenRuns,
                                        armed)
from tracer.events import capture, runs, schema, wire
from tracer.events.runs import RunArmed
from tracer.pipeline import Pipeline

C = wire.CONSTANTS


def _run(items: list) -> tuple[dict, Pipeline]:
    sink = Collected()
    p = Pipeline([sink], options=TrackerOptions(tenant_salt=b"k" * 16))
    for it in items:
        p.feed(it)
    p.close()
    return {(r.pid, r.fd, r.start_ns): dataclasses.asdict(r) for r in sink.records}, p


@pytest.fixture(scope="module")
def traffic() -> tuple[list, list]:
    items, truth = generate(300, 50, 1.0, 3, 10.0, gpu=True)
    return items, stage_runs(items)


def test_runs_give_every_request_what_one_record_per_write_gives(traffic):
    items, staged = traffic
    run_records = [i for i in staged if isinstance(i, bytes) and wire.kind_of(i) == C["KIND_RUN"]]
    writes = sum(len(schema.decode(r).lens) for r in run_records)
    data = sum(1 for i in staged if isinstance(i, bytes) and wire.kind_of(i) == C["KIND_DATA"])
    assert writes > 3 * data, "most token writes are in runs"
    a, pa = _run(items)
    b, pb = _run(staged)
    assert len(a) == 300 and a == b
    rep = pb.report()
    assert rep.get("token_runs_unread", 0) == 0 and not rep.get("parser_errors", 0)
    # all at once but for a new connection's first run (the process graph still reads
    # its first bytes): one per connection at most
    conns = sum(1 for i in items if isinstance(i, schema.SocketInfo))
    assert rep.get("token_runs_taken_write_by_write", 0) <= conns
    assert pa.reconciliation() == pb.reconciliation()


def test_a_capture_with_runs_replays_as_it_was_written(traffic, tmp_path):
    _, staged = traffic
    path = tmp_path / "runs.ttcap"
    w = capture.CaptureWriter(path, capture.new_header(command="test"), keep_secrets=True)
    for it in staged:
        w.write(it)
    w.close()
    back = list(capture.CaptureReader(path))
    assert sum(isinstance(i, RunArmed) for i in back) == sum(isinstance(i, RunArmed) for i in staged)
    assert _run(back)[0] == _run(staged)[0]


def test_a_run_read_twice_is_taken_once(traffic):
    """At stop the agent reads what is staged while the kernel may send it too."""
    _, staged = traffic
    i = next(k for k, it in enumerate(staged)
             if isinstance(it, bytes) and wire.kind_of(it) == C["KIND_RUN"])
    twice = staged[:i + 1] + [staged[i]] + staged[i + 1:]
    a, _ = _run(staged)
    b, p = _run(twice)
    assert a == b
    assert p.report()["token_run_writes_seen_twice"] == len(schema.decode(staged[i]).lens)


def test_malformed_and_unarmed_runs_are_counted_and_lose_only_their_writes(traffic):
    _, staged = traffic
    first = next(it for it in staged if isinstance(it, bytes) and wire.kind_of(it) == C["KIND_RUN"])
    run = schema.decode(first)
    n_field = wire.RUN.offsets["n"]
    bad = [first[:n_field] + (0).to_bytes(4, "little") + first[n_field + 4:],
           first[:n_field] + (33).to_bytes(4, "little") + first[n_field + 4:],
           first[:40]]
    sink = Collected()
    p = Pipeline([sink], options=TrackerOptions(tenant_salt=b"k" * 16))
    unarmed = runs.pack(run.pid, run.tid, run.fd, run.conn_id, run.stream_off, 999999,
                        list(run.ts), list(run.lens))
    for it in staged:
        p.feed(unarmed if it is first else it)
        if it is first:
            for b in bad:
                p.feed(b)
    p.close()
    rep = p.report()
    assert rep["undecodable_records"] == 3
    assert rep["token_runs_unread"] == 1 and rep["token_run_writes_unread"] == len(run.lens)
    assert len(sink.records) == 300  # the other requests, and this one, still end


def test_a_run_whose_lengths_fit_no_chunk_of_its_template_fails_its_connection_only(traffic):
    _, staged = traffic
    first = next(it for it in staged if isinstance(it, bytes) and wire.kind_of(it) == C["KIND_RUN"])
    run = schema.decode(first)
    broken = runs.pack(run.pid, run.tid, run.fd, run.conn_id, run.stream_off, run.arm,
                       list(run.ts), [3] * len(run.lens))
    _, p = _run([broken if it is first else it for it in staged])
    assert p.report().get("parser_errors", 0) >= 1


def test_fuzzed_runs_never_raise_and_lose_no_request(traffic):
    """Bytes flipped in RUN records' fields (connection, offset, arm, count, lengths)
    and records cut short. The times are left alone: the kernel's clock, not a peer,
    writes them (a capture corrupt there moves the stream's clock for every record)."""
    _, staged = traffic
    rng = random.Random(7)
    idx = [k for k, it in enumerate(staged)
           if isinstance(it, bytes) and wire.kind_of(it) == C["KIND_RUN"]][:40]
    ts_at, lens_at = wire.RUN.offsets["ts"], wire.RUN.offsets["len"]
    places = list(range(4, ts_at)) + list(range(lens_at, wire.RUN.header_size))
    for _ in range(20):
        items = list(staged)
        for k in rng.sample(idx, 5):
            b = bytearray(items[k])
            for _ in range(rng.randint(1, 8)):
                b[rng.choice(places)] = rng.randrange(256)
            items[k] = bytes(b[:rng.randint(4, len(b))] if rng.random() < 0.2 else b)
        sink = Collected()
        p = Pipeline([sink], options=TrackerOptions(tenant_salt=b"k" * 16))
        for it in items:
            p.feed(it)  # never raises: what it cannot take is counted
        p.close()
        assert len(sink.records) == 300


def test_a_chunk_is_rebuilt_at_its_length_from_its_template():
    head, tail = b'data: {"choices":[{"delta":{"content":', b'}}]}\n\n'
    for text in (b'""', b'"a"', b'"' + b"y" * 300 + b'"'):
        body = head + text + tail
        whole = b"%x\r\n" % len(body) + body + b"\r\n"
        assert runs.chunk_size(len(whole)) == len(body)
        rebuilt = runs.chunk(head, tail, len(whole))
        assert rebuilt is not None and len(rebuilt) == len(whole)
        assert rebuilt[:-len(tail) - 3].startswith(whole[:whole.index(b"\r\n") + 2] + head)
    assert runs.chunk(head, tail, 10) is None


@pytest.mark.parametrize("s", [b'""', b'"a b"', b'"\\"q\\""', b'"\\n"', b'"\\u00e9t\\u00e9"',
                               b'"\\\\"', "\"été\"".encode(), b'"a"b"', b'"\\x"', b'"\x01"',
                               b'"\\"', b'"abc'])
def test_the_kernels_json_string_check_agrees_with_the_parsers(s):
    """bpf/sockets.c's run_string, as bench/streamgen.py models it, accepts what the
    parser's template check does (it does not check the four digits after \\u)."""
    assert _plain_string(s) == (_JSON_STRING_BYTES.fullmatch(s) is not None)


def test_a_templates_hash_changes_with_any_one_byte_of_it():
    """The kernel stages a write whose head and tail hash as the armed template's
    (bpf/sockets.c run_hash; the lengths are checked apart): a chunk that differs from
    the template in any one byte, as a token's choice index or field name would, is
    never taken for it (each step of the hash is a bijection for a given word)."""
    head = (b'data: {"id":"chatcmpl-5d2b6f0e","object":"chat.completion.chunk",'
            b'"created":1765000000,"model":"/models/tiny-llama","system_fingerprint":null,'
            b'"choices":[{"index":0,"delta":{"role":"assistant","content":')
    base = wire.run_hash(head)
    for i in range(len(head)):
        for flip in (0x01, 0x20, 0x80):
            changed = head[:i] + bytes([head[i] ^ flip]) + head[i + 1:]
            assert wire.run_hash(changed) != base, (i, flip)
    assert wire.run_hash(b"") == 0
    assert wire.run_hash(b"\x01") == wire.RUN_HASH_K  # h = (rotl(0, 5) ^ 1) * K
    # a zero-padded last word: the same hash for b"a" and b"a\0", which is why the
    # kernel checks each length before it hashes
    assert wire.run_hash(b"a") == wire.run_hash(b"a\0")


def test_the_agent_asks_once_per_streamed_response(traffic):
    items, _ = traffic
    p = Pipeline([Collected()], options=TrackerOptions(tenant_salt=b"k" * 16))
    p.tracker.runs.arming = True
    for it in items:
        p.feed(it)
    asked = p.tracker.runs.take_requests()
    assert len(asked) == 300 and p.tracker.runs.take_requests() == []
    for key, head, tail in asked:
        assert head.startswith(b"data: {") and tail.endswith(b"\n\n")
        assert len(head) <= C["RUN_HEAD"] and len(tail) <= C["RUN_TAIL"]


def test_a_response_is_asked_again_only_when_its_tokens_still_come_one_by_one():
    """After the arm, a token chunk that still comes as its own record within
    REARM_AFTER_NS is one the kernel had no time to take; one later means the kernel
    disarmed (a write of the response did not fit): asked again, MAX_ASKS at most."""
    class Conn:
        key = (1, 5, 7)
        runs = None

    class Follower:
        template_bytes = (b"data: {", b"}\n\n")

    runs_ = TokenRuns(Counter())
    runs_.arming = True
    c, f = Conn(), Follower()
    runs_.token_chunk(c, 0, f, 1_000, b"")
    runs_.token_chunk(c, 0, f, 2_000, b"")  # no arm seen yet: not again
    assert len(runs_.take_requests()) == 1
    at = 10_000_000
    for k in range(MAX_ASKS + 2):
        armed(c, RunArmed(ts=at, pid=1, fd=5, conn_id=7, arm=k + 1, head="data: {",
                          tail="}\n\n"))
        runs_.token_chunk(c, 0, f, at + 1_000, b"")  # still the kernel's lag
        runs_.token_chunk(c, 0, f, at + REARM_AFTER_NS, b"")  # disarmed
        at += 2 * REARM_AFTER_NS
    assert len(runs_.take_requests()) == MAX_ASKS - 1
    assert len(c.runs.arms) == ARMS_KEPT
    runs_.token_chunk(c, 1, f, at, b"")  # the connection's next response
    assert len(runs_.take_requests()) == 1
