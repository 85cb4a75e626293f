"""The agent's fast paths give exactly what the general paths give.

A streamed LLM response is one write per token: the agent takes such a write with
shortcuts (``SSEParser._one_data_event``, ``ResponseFollower``'s chunk templates,
``http1._Direction.take_chunk``, ``ConnectionTracker.stream_write`` and
``Pipeline._stream_write``; issue 16). Each
is checked here against the same input with the shortcut turned off: generated
streams with the shapes that could fool one (escapes, control characters, empty
texts, finish reasons, usage, duplicate keys, other text-carrying fields, split
writes, CRLF), every committed capture, and synthetic traffic.
"""

from __future__ import annotations

import dataclasses
import json
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator
from unittest.mock import patch

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.streamgen import generate
from protocols import http1, openai
from protocols.openai import ResponseFollower
from protocols.sse import SSEParser
from tracer.correlate import ipc as ipc_mod
from tracer.correlate.connections import ConnectionTracker, TrackerOptions
from tracer.correlate.ipc import IpcGraph
from tracer.events import capture
from tracer.pipeline import Pipeline

ROOT = Path(__file__).resolve().parents[1]
CAPTURES = sorted((ROOT / "samples" / "captures").rglob("*.ttcap"))


@contextmanager
def general_paths() -> Iterator[None]:
    """Every shortcut off, inside the ``with``."""
    with ExitStack() as stack:
        stack.enter_context(patch.object(SSEParser, "_one_data_event",
                                         lambda self, chunk, ts: None))
        stack.enter_context(patch.object(openai, "MAX_TEMPLATE_TRIES", 0))
        stack.enter_context(patch.object(http1._Direction, "take_chunk",
                                         lambda self, data, ts: None))
        stack.enter_context(patch.object(ConnectionTracker, "stream_write",
                                         lambda self, c, *fields: False))
        stack.enter_context(patch.object(Pipeline, "_stream_write", lambda self, buf: False))
        stack.enter_context(patch.object(ResponseFollower, "sse_write",
                                         lambda self, ts, chunk: False))
        yield


# ---- generated streams -----------------------------------------------------------------

texts = st.sampled_from(["", " the", "a\"b", "\\", "\u00e9t\u00e9", "\u0000", "x\ny", "\ud83d",
                         "\"content\": \"", "}]}"]) | st.text(max_size=6)
raw_lits = st.sampled_from(['"a\tb"', '"\\q"', '"\\u12"', '"unterminated', '"a"b"', '""'])


@st.composite
def chunk_docs(draw: st.DrawFn, chat: bool) -> str:
    """One SSE data payload of a stream: mostly like its neighbours, sometimes not."""
    kind = draw(st.sampled_from(["token"] * 6 + ["finish", "usage", "role", "raw", "other",
                                                  "dup", "tool", "id", "error"]))
    key = "content" if chat else "text"
    sep = draw(st.sampled_from([(", ", ": "), (",", ":")]))
    rid = "chatcmpl-1" if kind != "id" else "chatcmpl-2"

    def doc(choice: dict, **extra: object) -> str:
        d = {"id": rid, "object": "chunk", "created": 7, "model": "m", "choices": [choice]}
        d.update(extra)
        return json.dumps(d, separators=sep)

    def holder(text: object) -> dict:
        if chat:
            return {"index": 0, "delta": {key: text}, "finish_reason": None}
        return {"index": 0, key: text, "finish_reason": None}

    text = draw(texts)
    if kind in ("token", "id"):
        return doc(holder(text))
    if kind == "finish":
        c = holder(text)
        c["finish_reason"] = "length"
        return doc(c)
    if kind == "usage":
        return doc(holder(text), usage={"prompt_tokens": 3, "completion_tokens": 9})
    if kind == "error":
        return doc(holder(text), error={"type": "overloaded"})
    if kind == "role":
        c = holder(text)
        if chat:
            c["delta"]["role"] = "assistant"
        return doc(c)
    if kind == "tool":
        c = holder(text)
        (c["delta"] if chat else c)["tool_calls"] = [{"id": "t"}]
        if chat:
            c["delta"]["reasoning_content"] = draw(st.sampled_from(["", "why"]))
        return doc(c)
    if kind == "dup":  # a second, escaped key the parser takes over the first
        base = doc(holder(text))
        esc = json.dumps(key).replace(key[1], "\\u%04x" % ord(key[1]))
        return base.replace(json.dumps(key, separators=sep), f"{json.dumps(key)}{sep[1]}\"a\","
                            f" {esc}", 1)
    if kind == "other":
        return draw(st.sampled_from(["[DONE]", "not json", "[1, 2]", "{}", " [DONE] "]))
    lit = draw(raw_lits)  # a literal the json module refuses, or an odd one
    return doc(holder("@@")).replace('"@@"', lit)


def follow(payloads: list[str], operation: str, keep_text: bool = False):
    """What a follower makes of these SSE data payloads, one write each (a payload
    starting with ``event:`` is written as that line alone), offered to ``sse_write``
    first as the tracker does."""
    f = ResponseFollower(operation, keep_text)
    f.head(0, 200, {"content-type": "text/event-stream"})
    for i, p in enumerate(payloads):
        raw = p.encode("utf-8", "surrogatepass")
        w = raw + b"\n" if p.startswith("event:") else b"data: " + raw + b"\n\n"
        if not f.sse_write(10 + i, w):
            f.data(10 + i, w)
    return dataclasses.asdict(f.end(999)), f._sse._event if f._sse else None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.booleans(), st.data())
def test_chunk_templates_count_as_json_would(chat, data):
    payloads = data.draw(st.lists(chunk_docs(chat) | st.just("event: e"), max_size=14))
    op = "chat" if chat else "text_completion"
    fast = follow(payloads, op)
    with general_paths():
        assert follow(payloads, op) == fast


def test_a_template_is_used_for_the_tokens_of_a_stream():
    """(So the test above is not comparing the general path with itself.)"""
    f = ResponseFollower("chat")
    f.head(0, 200, {"content-type": "text/event-stream"})
    doc = '{"id": "c", "choices": [{"index": 0, "delta": {"content": "%s"}, "finish_reason": null}]}'
    for i, t in enumerate(["a", "b", "", "c\\\"d"]):
        f.data(i, b"data: " + (doc % t).encode() + b"\n\n")
    assert f._template is not None and f._template.text_of(doc % "zz") == '"zz"'
    assert f.r.text_chunks == 3 and f.r.chunks == 4 and f.r.token_ts == [0, 1, 3]


sse_lines = st.sampled_from([b"data: {\"a\": 1}", b"data:x", b"data: ", b"event: e", b"id: 7",
                             b": keep", b"data: [DONE]", b"", b"data: a\rb", b"retry: 3"])
token_writes = st.sampled_from([b"data: {\"a\": 1}\n\n", b"data:x\r\n\r\n", b"data: \n\n",
                                b"data: t\n\n\n", b"data: a\nb\n\n", b"data: y\r\n\n",
                                b"id: 3\ndata: z\n\n", b"event: e\n"])
line_writes = st.builds(lambda lines, eol, end: b"".join(x + eol for x in lines) + (eol if end else b""),
                        st.lists(sse_lines, max_size=3), st.sampled_from([b"\n", b"\r\n", b"\r"]),
                        st.booleans())


@settings(max_examples=500, deadline=None)
@given(st.lists(token_writes | line_writes, max_size=12))
def test_sse_events_are_the_line_loops(chunks):
    def parse() -> list:
        p = SSEParser()
        return [tuple(e) for i, c in enumerate(chunks) for e in p.feed(c, i)]

    fast = parse()
    with general_paths():
        assert parse() == fast


def _chunk(body: bytes, ext: bytes = b"") -> bytes:
    return b"%x%s\r\n%s\r\n" % (len(body), ext, body)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.binary(min_size=1, max_size=12),
                          st.sampled_from(["whole", "whole", "split", "head", "ext", "joined",
                                           "upper", "nested"])), max_size=8))
def test_whole_chunks_frame_as_llhttp_does(parts):
    """Writes that are whole chunks, and others that are not (a size line alone, a chunk
    cut in two, two chunks in one write, extensions, upper-case hex, a size line alone
    followed by data that looks like a whole chunk itself)."""
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    writes = [head]
    for body, how in parts:
        c = _chunk(body, b";x=1" if how == "ext" else b"")
        if how == "upper":
            c = c.upper() if body.isalpha() else c
        if how == "split":
            writes += [c[:len(c) // 2], c[len(c) // 2:]]
        elif how == "nested":  # its data and CRLF look like a whole chunk of their own
            c = _chunk(b"%x\r\n" % len(body) + body)
            cut = c.index(b"\r\n") + 2
            writes += [c[:cut], c[cut:]]
        elif how == "head":
            cut = c.index(b"\r\n") + 2
            writes += [c[:cut], c[cut:]]
        elif how == "joined":
            writes += [c + _chunk(body)]
        else:
            writes.append(c)
    writes.append(b"0\r\n\r\n")

    def parse() -> list:
        c = http1.HTTP1Connection()
        out = c.receive(b"GET / HTTP/1.1\r\n\r\n", 0, True)
        for i, w in enumerate(writes):
            out += c.receive(w, i + 1, False)
        return [tuple(dataclasses.astuple(e)) if dataclasses.is_dataclass(e) else tuple(e)
                for e in out]

    fast = parse()
    with general_paths():
        assert parse() == fast


# ---- whole captures --------------------------------------------------------------------


def _replay(items: list, header: dict) -> tuple[list, dict]:
    recs: list = []

    class Sink:
        def on_record(self, r) -> None:
            recs.append(r)

        def close(self) -> None:
            pass

    p = Pipeline([Sink()], options=TrackerOptions(
        tenant_salt=capture.tenant_salt(header),
        secrets_masked=header.get("secrets_masked") is True))
    for it in items:
        p.feed(it)
    p.close()
    return [repr(dataclasses.replace(r, process=None)) for r in recs], p.report()


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_captures_replay_the_same(path):
    r = capture.CaptureReader(path)
    items = list(r)
    fast = _replay(items, r.header)
    with general_paths():
        general = _replay(items, r.header)
    assert general[0] == fast[0]
    # a token run the shortcut could not take is taken write by write and counted: with
    # the shortcut off, that is every run (a capture recorded with token runs)
    path_taken = {"token_runs_taken_write_by_write"}
    assert ({k: v for k, v in general[1].items() if k not in path_taken}
            == {k: v for k, v in fast[1].items() if k not in path_taken})


def test_synthetic_streams_replay_the_same_and_exactly():
    items, truth = generate(rate=120, tokens=40, seconds=1.0, servers=2, gpu=True)
    fast = _replay(items, {"tenant_salt": "x"})
    assert len(fast[0]) == len(truth) and fast[1]["requests"] == len(truth)
    with general_paths():
        assert _replay(items, {"tenant_salt": "x"}) == fast


def test_the_stream_shortcut_is_taken(monkeypatch):
    items, truth = generate(rate=60, tokens=30, seconds=0.5, servers=1, gpu=False)
    taken = []
    real = ConnectionTracker.stream_write

    def spy(self, c, *fields):
        ok = real(self, c, *fields)
        taken.append(ok)
        return ok

    monkeypatch.setattr(ConnectionTracker, "stream_write", spy)
    _replay(items, {"tenant_salt": "x"})
    # every token, finish, usage and [DONE] write after a connection's first few
    assert sum(taken) >= 0.8 * len(truth) * 30


# ---- the process graph's fingerprints ----------------------------------------------------


def test_ends_seen_from_their_start_link_by_their_first_bytes():
    ipc = IpcGraph()
    msg = b'{"type": "submit", "id": "cmpl-0123456789abcdef", "prompt_ids": [1, 2, 3]}'
    assert ipc.data(1, 9, 1, False, msg, 100, start=True)  # writer wants more
    ipc.data(7, 4, 2, True, msg, 120, start=True)
    assert ipc.edges() == [(1, 7, ["payload"])]


def test_a_reader_from_the_start_is_not_a_writers_later_bytes():
    """Both seen from their first byte, the same flow starts with the same bytes: a
    reader whose first bytes sit later in a writer's head is another flow."""
    ipc = IpcGraph()
    msg = b"x" * 10 + b'{"type": "submit", "id": "cmpl-0123456789abcdef"}' * 2
    ipc.data(1, 9, 1, False, msg, 100, start=True)
    ipc.data(7, 4, 2, True, msg[10:], 120, start=True)
    assert ipc.edges() == []
    ipc.data(8, 4, 2, True, msg[10:], 120, start=False)  # attached mid-stream: a substring
    assert ipc.edges() == [(1, 8, ["payload"])]


def test_a_writer_from_the_start_searches_only_readers_found_open():
    """A writer seen from its start is searched against the readers found open at
    attach only (a reader seen from its start would have matched by its first bytes):
    the many readers of new connections are not scanned, and an evicted one is gone."""
    ipc = IpcGraph()
    msg = b"\x00\x00\x01\x6d" + b'{"step": 1, "members": [{"id": "cmpl-7b12d8e0f1514c32"}]}'
    for i in range(ipc_mod.MAX_PENDING):  # new connections' requests, seen from the start
        ipc.data(100 + i, 4, i, True, b"GET /v1/models HTTP/1.1\r\nHost: x%04d\r\n\r\n...." % i,
                 110, start=True)
    ipc.data(5, 4, 1, True, msg[4:], 115)  # found open at attach, mid-message
    assert ipc._open_readers and len(ipc._readers) == ipc_mod.MAX_PENDING
    ipc.data(4, 5, 1, False, msg, 120, start=True)
    assert ipc.edges() == [(4, 5, ["payload"])]
    assert not ipc._open_readers  # matched: out of both lists

    evicted = IpcGraph()
    evicted.data(5, 4, 1, True, msg[4:], 115)
    for i in range(ipc_mod.MAX_PENDING):  # pushes the open reader out, oldest first
        evicted.data(100 + i, 4, i, True, b"%04d" % i * 12, 116, start=True)
    assert not evicted._open_readers
    evicted.data(4, 5, 1, False, msg, 120, start=True)
    assert evicted.edges() == []


def test_a_writer_head_growing_write_by_write_finds_a_reader_across_writes():
    ipc = IpcGraph()
    msg = b"\x00\x00\x01\x6d" + b'{"step": 1, "members": [{"id": "cmpl-7b12d8e0f1514c32"}]}'
    ipc.data(5, 4, 1, True, msg[4:], 130)  # a reader found open at attach
    for i in range(0, len(msg), 7):
        ipc.data(4, 5, 1, False, msg[i:i + 7], 120)
    assert ipc.edges() == [(4, 5, ["payload"])]
