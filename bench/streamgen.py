"""Synthetic capture traffic at a chosen rate: what the probes would send for N
OpenAI-style servers streaming chat completions, as raw wire records.

The records are the kernel's own layouts (``tracer.events.wire``), and the bytes are
what uvicorn writes for an OpenAI chat stream (as recorded from ``samples/openai_server``
and HF ``transformers serve``): chunked transfer encoding, one write per SSE event (the
role chunk, one per token, the finish chunk, the usage chunk when asked, ``[DONE]``,
the terminating chunk). Each server is one process with an API thread and an engine
thread that runs a decode step every ``step_ms``: every running request gets one token
per step, a new request its first token at the step after it arrived (prefill). With
``--gpu`` each step is a kernel burst ended by a sync on the engine thread, as the CUDA
probes report it.

Connections are keep-alive, reused once their response ended; a request arriving
with none free opens (accepts) a new one. Half of the requests ask for
``stream_options.include_usage`` (output tokens from ``usage``), the other half are
counted from the chunks. ``Truth`` says what the tracer must report for each request.

    from bench.streamgen import generate
    items, truth = generate(rate=1000, tokens=100, seconds=5, servers=8)
"""

from __future__ import annotations

import heapq
import json
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

from tracer.events import runs, schema, wire
from tracer.events.netwait import NetTimingMode
from tracer.events.runs import RunArmed

C = wire.CONSTANTS
BASE_TS = 10**12  # monotonic ns of the first event
STEP_LAUNCHES = 60  # kernels per decode step (a small model's layers)
HANDLES = tuple(0x7F00_0000_1000 + 0x40 * i for i in range(12))


@dataclass
class Truth:
    """What the tracer should say of one request."""

    pid: int
    fd: int
    read_ts: int  # the request's read (syscall start of the span)
    first_token_ts: int  # the write of its first content chunk
    last_token_ts: int
    tokens: int
    include_usage: bool


def _data(pid: int, tid: int, fd: int, conn_id: int, ts: int, direction: int,
          payload: bytes, stream_off: int) -> bytes:
    syscall = C["SYS_READ"] if direction == C["DIR_IN"] else C["SYS_WRITE"]
    head = wire.DATA.header.pack(C["KIND_DATA"], pid, tid, fd, conn_id, ts - 2000, ts,
                                 len(payload), 0, len(payload), syscall, direction,
                                 C["FLAG_LAST"], 0, stream_off)
    return head + payload


def _conn_raw(pid: int, tid: int, fd: int, conn_id: int, ts: int, port: int) -> bytes:
    raw = wire.CONN.header.pack(C["KIND_CONN"], pid, tid, fd, ts, conn_id, 0, 3,
                                C["CONN_ACCEPT"], C["ROLE_SERVER"], 2, port,
                                bytes([127, 0, 0, 1]) + bytes(12))
    return raw + bytes(wire.CONN.size - len(raw))


def _arrival(pid: int, tid: int, fd: int, conn_id: int, ts: int, read_ts: int,
             stream_off: int, first: bool, estab: int) -> bytes:
    flags = C["NW_FLAG_ANCHORED"] | (C["NW_FLAG_FIRST"] if first else 0)
    raw = wire.NETWAIT.header.pack(C["KIND_NETWAIT"], pid, tid, fd, conn_id, C["NW_ARRIVAL"],
                                   0, flags, ts, read_ts, stream_off, estab if first else 0)
    return raw + bytes(wire.NETWAIT.size - len(raw))


def _burst(pid: int, tid: int, first: int, last: int, launches: int, wait: int) -> bytes:
    per = launches // len(HANDLES)
    counts = [per] * len(HANDLES)
    counts[0] += launches - per * len(HANDLES)
    handles = list(HANDLES) + [0] * (C["BURST_SLOTS_N"] - len(HANDLES))
    counts += [0] * (C["BURST_SLOTS_N"] - len(counts))
    raw = wire.KBURST.header.pack(
        C["KIND_KBURST"], pid, tid, C["BURST_SYNC"], C["SYNC_STREAM"], first, last,
        launches, 0, 0, 4096, 0, 0, 0, 1, 0, 0, 0, 0, 1, wait, 0, len(HANDLES),
        *handles, *counts)
    return raw + bytes(wire.KBURST.size - len(raw))


def _chunk(body: bytes) -> bytes:
    """One HTTP/1.1 chunk of a chunked body."""
    return b"%x\r\n" % len(body) + body + b"\r\n"


def _sse(doc: dict[str, Any]) -> bytes:
    return _chunk(b"data: " + json.dumps(doc).encode() + b"\n\n")


WORDS = (" the", " model", " a", " token", " step", " of", " GPU", " batch", "\u00e9t\u00e9",
         " \"quoted\"", "\\n", " cache")


class _Stream:
    """One request's response, written one SSE event per decode step."""

    def __init__(self, n: int, tokens: int, include_usage: bool, created: int) -> None:
        self.id = f"chatcmpl-{uuid.UUID(int=n).hex[:24]}"
        self.tokens = tokens
        self.include_usage = include_usage
        self.created = created
        self.sent = 0

    def _doc(self, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": "tiny-llama", "choices": [{"index": 0, "delta": delta,
                                                    "finish_reason": finish}]}

    def head(self) -> list[bytes]:
        return [b"HTTP/1.1 200 OK\r\ndate: Wed, 25 Nov 2026 02:57:52 GMT\r\nserver: uvicorn\r\n"
                b"content-type: text/event-stream; charset=utf-8\r\n"
                b"transfer-encoding: chunked\r\n\r\n",
                _sse(self._doc({"role": "assistant", "content": ""}, None))]

    def token(self) -> bytes:
        word = WORDS[(self.sent * 7 + len(self.id)) % len(WORDS)]
        self.sent += 1
        return _sse(self._doc({"content": word}, None))

    def tail(self) -> list[bytes]:
        out = [_sse(self._doc({}, "length"))]
        if self.include_usage:
            out.append(_sse({"id": self.id, "object": "chat.completion.chunk",
                             "created": self.created, "model": "tiny-llama", "choices": [],
                             "usage": {"prompt_tokens": 12, "completion_tokens": self.tokens,
                                       "total_tokens": 12 + self.tokens}}))
        out.append(_chunk(b"data: [DONE]\n\n"))
        out.append(b"0\r\n\r\n")
        return out


def _request(n: int, port: int, tokens: int, include_usage: bool) -> bytes:
    body = {"model": "tiny-llama", "stream": True, "max_tokens": tokens,
            "messages": [{"role": "user", "content": f"prompt number {n} " * 8}]}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    raw = json.dumps(body, separators=(",", ":")).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Accept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\n"
            "authorization: Bearer sk-synthetic\r\naccept: application/json\r\n"
            "content-type: application/json\r\nuser-agent: OpenAI/Python 1.0\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode()
    return head + raw


class _Conn:
    def __init__(self, fd: int, conn_id: int) -> None:
        self.fd = fd
        self.conn_id = conn_id
        self.bytes_in = 0
        self.bytes_out = 0
        self.first = True


def _server(index: int, rate: float, tokens: int, seconds: float, step_ns: int,
            gpu: bool, first_n: int) -> Iterator[tuple[int, int, Any, Truth | None]]:
    """(ts, seq, item, truth) of one server process, in time order."""
    pid = 5000 + index
    api, engine = pid, pid + 1
    port = 8000 + index
    gap = int(1e9 / rate)
    offset = index * 131_071  # servers not in lock step
    arrivals = [BASE_TS + offset + i * gap for i in range(int(rate * seconds))]
    free: list[_Conn] = []
    next_fd = 20
    seq = 0
    out: list[tuple[int, int, Any, Truth | None]] = []

    def put(ts: int, item: Any, truth: Truth | None = None) -> None:
        nonlocal seq
        out.append((ts, seq, item, truth))
        seq += 1

    running: list[tuple[_Conn, _Stream, Truth]] = []
    waiting: list[tuple[int, _Conn, _Stream, Truth]] = []
    t_step = BASE_TS + offset + step_ns // 2
    i = 0
    end = BASE_TS + offset + int(seconds * 1e9)
    n_req = first_n
    while i < len(arrivals) or running or waiting:
        # requests that arrive before this step begins: read now, prefilled in it
        while i < len(arrivals) and arrivals[i] < t_step:
            ts = arrivals[i]
            i += 1
            if free:
                c = free.pop()
            else:
                c = _Conn(next_fd, ts - 50_000)
                next_fd += 1
                put(ts - 50_000, _conn_raw(pid, api, c.fd, c.conn_id, ts - 50_000, 40000 + c.fd))
                # the live capture follows each accept with the listener's address
                put(ts - 50_000, schema.SocketInfo(
                    pid=pid, fd=c.fd, conn_id=c.conn_id, ts=ts - 50_000, family=2,
                    local_addr="127.0.0.1", local_port=port, peer_addr="127.0.0.1",
                    peer_port=40000 + c.fd, role=C["ROLE_SERVER"]))
            usage = n_req % 2 == 0
            req = _request(n_req, port, tokens, usage)
            s = _Stream(n_req, tokens, usage, 1795575472 + (ts - BASE_TS) // 10**9)
            n_req += 1
            put(ts, _arrival(pid, api, c.fd, c.conn_id, ts - 30_000, ts, c.bytes_in, c.first,
                             c.conn_id + 20_000))
            c.first = False
            put(ts, _data(pid, api, c.fd, c.conn_id, ts, C["DIR_IN"], req, c.bytes_in))
            c.bytes_in += len(req)
            t = Truth(pid, c.fd, ts, 0, 0, tokens, usage)
            waiting.append((ts, c, s, t))
        step_end = t_step + step_ns - 200_000
        if gpu and (running or waiting):
            put(step_end, _burst(pid, engine, t_step, step_end, STEP_LAUNCHES, 150_000))
        # the step's tokens, written by the API thread right after the step
        w = step_end + 20_000
        for _, c, s, t in waiting:
            for b in s.head():
                put(w, _data(pid, api, c.fd, c.conn_id, w, C["DIR_OUT"], b, c.bytes_out))
                c.bytes_out += len(b)
                w += 3_000
            running.append((c, s, t))
        waiting = []
        still = []
        for c, s, t in running:
            b = s.token()
            put(w, _data(pid, api, c.fd, c.conn_id, w, C["DIR_OUT"], b, c.bytes_out))
            c.bytes_out += len(b)
            if s.sent == 1:
                t.first_token_ts = w
            t.last_token_ts = w
            w += 3_000
            if s.sent < s.tokens:
                still.append((c, s, t))
                continue
            for b in s.tail():
                put(w, _data(pid, api, c.fd, c.conn_id, w, C["DIR_OUT"], b, c.bytes_out))
                c.bytes_out += len(b)
                w += 2_000
            put(w, None, t)  # the truth, in order (an item of None is not emitted)
            free.append(c)
        running = still
        t_step += step_ns
        if t_step > end + 600 * step_ns:
            break
    out.sort(key=lambda x: (x[0], x[1]))
    yield from out


def generate(rate: float, tokens: int = 100, seconds: float = 5.0, servers: int = 8,
             step_ms: float = 10.0, gpu: bool = True
             ) -> tuple[list[Any], list[Truth]]:
    """Capture items (raw wire records and user events, in time order) for ``rate``
    requests/s spread over ``servers`` processes, and the truth of each request."""
    items: list[Any] = [schema.ClockSync(mono_ns=BASE_TS, wall_ns=1_795_000_000 * 10**9),
                        NetTimingMode(ts=BASE_TS, mode="socket")]
    for k in range(servers):
        pid = 5000 + k
        items.append(schema.ProcessInfo(pid=pid, ts=BASE_TS, comm="python3",
                                        exe="/usr/bin/python3", cmdline=("python3", "serve")))
    streams = [_server(k, rate / servers, tokens, seconds, int(step_ms * 1e6), gpu,
                       k * 10**7) for k in range(servers)]
    truth: list[Truth] = []
    for ts, _, item, t in heapq.merge(*streams, key=lambda x: x[0]):
        if item is None:
            truth.append(t)  # type: ignore[arg-type]
        else:
            items.append(item)
    items.append(schema.DropReport(ts=BASE_TS + int((seconds + 10) * 1e9), counters={}))
    return items, truth


# ---- the kernel's token runs (bpf/sockets.c), modelled ------------------------------

_RUN_MAX = C["RUN_MAX"]


def _plain_string(s: bytes) -> bool:
    """What bpf/sockets.c's run_string accepts: one JSON string of at most 256 bytes
    (a backslash's next byte one of JSON's escapes; \\u's digits not checked)."""
    if len(s) < 2 or len(s) > 256 or s[:1] != b'"' or s[-1:] != b'"':
        return False
    esc = False
    for c in s[1:-1]:
        if esc:
            if c not in b'"\\/bfnrtu':
                return False
            esc = False
        elif c == 0x5C:
            esc = True
        elif c == 0x22 or c < 0x20:
            return False
    return not esc


def _token_event(payload: bytes) -> tuple[bytes, bytes, bytes] | None:
    """A token chunk's SSE head, JSON string and tail (the generator's documents
    carry the text as ``"content": "..."`` in ``delta``)."""
    line_end = payload.find(b"\r\n")
    event = payload[line_end + 2:-2]
    at = event.find(b'"content": "')
    if line_end < 0 or at < 0 or b'"finish_reason": null' not in event:
        return None
    start = at + len(b'"content": ')
    end = event.rindex(b"}, \"finish_reason\"")  # the text's holder ends there
    return event[:start], event[start:end], event[end:]


def stage_runs(items: list[Any], arm_delay_ns: int = 20_000_000) -> list[Any]:
    """``items`` as a live run with token runs would capture them: the agent arms a
    response ``arm_delay_ns`` after the first text chunk it read (its poll), with a
    ``RunArmed`` event; from then the kernel stages the response's writes that are one
    chunk of the template with a plain JSON string, and sends them as RUN records as
    bpf/sockets.c does (RUN_MAX writes, RUN_AGE_NS old at the next staged write, another
    thread or offset, or any other DATA or CONN record of the connection first). A
    chunk whose string has escapes goes out as it was (the run first); any other write
    disarms."""
    out: list[Any] = []
    pending: list[tuple[int, Any]] = []  # (ts, RunArmed) not yet written
    arms: dict[tuple[int, int, int], tuple[int, bytes, bytes]] = {}
    asked: set[tuple[int, int, int, int]] = set()  # (key, response start offset)
    stages: dict[tuple[int, int, int], dict[str, Any]] = {}
    response_at: dict[tuple[int, int, int], int] = {}
    seq = 0

    def flush(key: tuple[int, int, int]) -> None:
        s = stages.pop(key, None)
        if s is not None:
            out.append(runs.pack(key[0], s["tid"], key[1], key[2], s["off"], s["arm"],
                                 s["ts"], s["lens"]))

    for item in items:
        ts = getattr(item, "ts", None)
        if isinstance(item, bytes) and wire.kind_of(item) in (C["KIND_DATA"], C["KIND_CONN"]):
            ts = (wire.DATA.unpack(item)["ts_exit"] if wire.kind_of(item) == C["KIND_DATA"]
                  else wire.CONN.unpack(item)["ts"])
        while pending and ts is not None and pending[0][0] <= ts:
            ev = pending.pop(0)[1]
            arms[ev.key] = (ev.arm, ev.head.encode(), ev.tail.encode())
            out.append(ev)
        if not isinstance(item, bytes) or wire.kind_of(item) not in (C["KIND_DATA"],
                                                                     C["KIND_CONN"]):
            out.append(item)
            continue
        if wire.kind_of(item) == C["KIND_CONN"]:
            f = wire.CONN.unpack(item)
            key = (f["pid"], f["fd"], f["conn_id"])
            flush(key)
            if f["op"] == C["CONN_CLOSE"]:
                arms.pop(key, None)
            out.append(item)
            continue
        f = wire.DATA.unpack(item)
        key = (f["pid"], f["fd"], f["conn_id"])
        payload = item[wire.DATA.header_size:wire.DATA.header_size + f["len"]]
        if f["direction"] == C["DIR_IN"]:
            response_at[key] = -1
        elif response_at.get(key) == -1:
            response_at[key] = f["stream_off"]  # this response's first write
        arm = arms.get(key)
        if f["direction"] == C["DIR_OUT"] and arm is not None:
            parts = _token_event(payload) if len(payload) <= C["RUN_WRITE_MAX"] else None
            fits = parts is not None and parts[0] == arm[1] and parts[2] == arm[2]
            if fits and _plain_string(parts[1]):  # type: ignore[index]
                s = stages.get(key)
                if s is not None and (len(s["ts"]) >= _RUN_MAX or s["end"] != f["stream_off"]
                                      or s["tid"] != f["tid"] or s["arm"] != arm[0]
                                      or f["ts_exit"] - s["ts"][0] >= C["RUN_AGE_NS"]):
                    flush(key)
                    s = None
                if s is None:
                    s = stages[key] = {"tid": f["tid"], "off": f["stream_off"], "arm": arm[0],
                                       "ts": [], "lens": [], "end": f["stream_off"]}
                s["ts"].append(f["ts_exit"])
                s["lens"].append(len(payload))
                s["end"] = f["stream_off"] + len(payload)
                if len(s["ts"]) >= _RUN_MAX:
                    flush(key)
                continue
            if not fits:
                del arms[key]
        flush(key)
        out.append(item)
        # the agent reads a token chunk and asks for its response to be armed
        parts = _token_event(payload) if f["direction"] == C["DIR_OUT"] else None
        ask = (key, response_at.get(key, 0))
        if (parts is not None and ask not in asked and parts[1] != b'""'
                and _plain_string(parts[1])):  # a token's chunk (the role chunk is not)
            asked.add(ask)
            seq += 1
            pending.append((f["ts_exit"] + arm_delay_ns, RunArmed(
                ts=f["ts_exit"] + arm_delay_ns, pid=key[0], fd=key[1], conn_id=key[2], arm=seq,
                head=parts[0].decode(), tail=parts[2].decode())))
            pending.sort(key=lambda p: p[0])
    for key in list(stages):
        flush(key)
    out.extend(ev for _, ev in pending)
    return out
