"""Helpers for tests with real probes: trace a process in the background, collect
records and spans, and an openai client that times its own requests."""

from __future__ import annotations

import io
import json
import re
import socket
import ssl
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import httpcore2
import httpx2
import openai
from httpcore2._exceptions import map_exceptions
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from tracer.correlate.connections import TrackerOptions
from tracer.export.context import ExportContext
from tracer.export.jsonl import JsonlSpanExporter
from tracer.export.spans import SpanBuilder
from tracer.probes.session import CaptureConfig
from tracer.runner import TraceRun

from tests.kstamps import StampedSocket


class Collected:
    """Records and JSONL spans of one traced stretch, plus the loss report."""

    def __init__(self) -> None:
        self.records: list[Any] = []
        self.report: dict[str, int] = {}
        self.gpu: dict[str, Any] = {}  # the GPU ledger's --summary part, after the stop
        self.reconciliation: dict[str, Any] = {}
        self.naming: dict[str, Any] | None = None  # stub naming and before-attach state
        self.stacks: Any = None
        self.sampler: Any = None  # the session's StackSampler, while it runs (stack_every=N)
        self.run: Any = None  # the TraceRun, while it runs (its control commands)
        self._jsonl = io.StringIO()

    def on_record(self, rec: Any) -> None:
        self.records.append(rec)

    def close(self) -> None:
        pass

    @property
    def spans(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self._jsonl.getvalue().splitlines()]


@contextmanager
def traced(pids: list[int] | None = None, ports: list[int] | None = None,
           settle: float = 0.3, record: str | None = None, extra_sinks: list[Any] = (),
           **config: Any) -> Iterator[Collected]:
    """Trace ``pids``/``ports`` for the duration of the block; ``extra_sinks`` see each
    record before the collector does."""
    c = Collected()
    ctx = ExportContext()
    ctx.flames = {}  # spans carry their launch-site stacks (with stack_every=N)
    spans = SpanBuilder(ctx, [SimpleSpanProcessor(JsonlSpanExporter(c._jsonl, ctx.flames))])
    keep = config.pop("keep_content", False)
    pricing = config.pop("pricing", None)
    auto = config.pop("auto_sample", None)  # --gpu-sample auto's policy (tracer/autosample.py)
    # the overhead meter and budget (tracer/overhead.py): max_overhead, meter_every_s...
    meter = {k: config.pop(k) for k in ("max_overhead", "meter_every_s", "meter_window_s")
             if k in config}
    run = TraceRun(CaptureConfig(pids=pids or [], ports=ports or [], **config),
                   [*extra_sinks, c, spans],
                   TrackerOptions(keep_content=keep), record=record, ctx=ctx, pricing=pricing,
                   auto_sample=auto, **meter)
    run.start()
    c.sampler = run.session.stacks
    c.run = run
    try:
        yield c
    finally:
        time.sleep(settle)  # the last writes and closes reach the ring buffer
        gpu = run.session.gpu
        c.naming = gpu.stubs.state() if gpu is not None else None
        c.report = run.stop()
        c.gpu = run.pipeline.gpu.summary()
        c.stacks = run.pipeline.stacks  # launch-site stacks the run saw (stack_every=N)
        c.reconciliation = run.pipeline.reconciliation()


def spans_by_response_id(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Request spans by ``gen_ai.response.id``; a response id on two spans fails."""
    out: dict[str, dict[str, Any]] = {}
    for s in spans:
        rid = s["attributes"].get("gen_ai.response.id")
        if rid:
            assert rid not in out, f"two spans for {rid}"
            out[rid] = s
    return out


def off_by(span_s: float, client_s: float, attrs: dict[str, Any]) -> float:
    """How far a span's time (TTFT, duration) is from the client's, seconds. Where an
    ACK the kernel skipped the probe for hides when the response's bytes left, the
    span gives the earliest time and ``tokentrace.network.departure_unknown`` how much
    later they may have left: the client's time must lie in that interval."""
    unknown = attrs.get("tokentrace.network.departure_unknown", 0.0)
    return max(span_s - client_s, client_s - span_s - unknown, 0.0)


def client_output_tokens(c: dict[str, Any]) -> int | None:
    """The output tokens a client's result says: the usage it got, else its text chunks
    (a token each, as the tracer counts a stream without usage). None for a stream with
    neither: the model's first token ended it (HF's tiny random Llama does, now and
    then: a role chunk, then ``finish_reason: stop``), and the tracer leaves the count
    unset rather than invent one."""
    if c["output_tokens"] is not None:
        return c["output_tokens"]
    return c["text_chunks"] or None


def timing_rows(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> str:
    """One line per (client result, span attributes): the signed difference span -
    client and the span's network timing, so a failed bar says which request was off,
    which way and by what the tracer explained (a hold, a socket wait)."""
    key, span_key = "ttft", "tokentrace.time_to_first_token"
    lines = []
    for c, a in pairs:
        if c.get(key) is None or span_key not in a:
            continue
        net = {k.removeprefix("tokentrace.network."): v for k, v in a.items()
               if k.startswith("tokentrace.network.") and k != "tokentrace.network.timing"}
        lines.append(f"{(a[span_key] - c[key]) * 1e3:+8.3f} ms  client {c[key] * 1e3:8.3f}"
                     f"  port {c.get('client_port')}  {net}")
    return "\n".join(lines)


def bounded(spans: list[dict[str, Any]]) -> int:
    """How many spans' departures were bounded, not timed (``off_by``)."""
    return sum(1 for s in spans if s["attributes"].get("tokentrace.network.departure_unknown"))


FIRST_TEXT = re.compile(rb'"(?:content|text)": ?"(?:[^"\\]|\\.)')


class _StampedTLS:
    """TLS on memory BIOs over the client's stamped socket, read one whole record at a
    time, so each piece of plaintext comes with the kernel's arrival stamp of the
    segment that completed its record (the moment it could be decrypted) and each write
    with the TX stamp of its last ciphertext byte. An ``ssl.SSLSocket`` would read the
    socket inside OpenSSL, out of reach of the stamps, and the client would have to time
    its reads by its own clock, its waits for a CPU included (on the 2-vCPU CI VM one
    request in eight came out 9 ms longer than the tracer's TTFT that way)."""

    def __init__(self, stamped: StampedSocket, ctx: ssl.SSLContext,
                 server_hostname: str | None, timeout: float | None) -> None:
        self.stamped = stamped
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self._in, self._out, server_hostname=server_hostname)
        self._plain = b""  # decrypted, not yet read
        self._plain_at: int | None = None  # the arrival of the record it came from
        stamped.sock.settimeout(timeout)
        while True:
            try:
                self.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                if self._record() is None:
                    raise ConnectionError("the server closed the connection in the handshake")
        self._flush()

    def _flush(self) -> int | None:
        """Send what OpenSSL has written; the TX stamp of its last byte."""
        data = self._out.read()
        if not data:
            return None
        self.stamped.sock.sendall(data)
        return self.stamped.sent(len(data))

    def _record(self) -> int | None:
        """One TLS record into OpenSSL; the arrival of the segment holding its last
        byte (None at the end of the stream)."""
        header, _, _ = self.stamped.recv_exactly(5)
        if not header:
            return None
        if len(header) < 5:
            raise ConnectionError("the server closed the connection mid-record")
        size = int.from_bytes(header[3:5], "big")
        body, at, _ = self.stamped.recv_exactly(size)
        if len(body) < size:
            raise ConnectionError("the server closed the connection mid-record")
        self._in.write(header + body)
        return at

    def write(self, buffer: bytes, timeout: float | None = None) -> int | None:
        """Encrypt and send ``buffer``; the TX stamp of its last byte (realtime ns)."""
        self.stamped.sock.settimeout(timeout)
        self.obj.write(buffer)
        return self._flush()

    def read(self, max_bytes: int, timeout: float | None = None) -> tuple[bytes, int | None]:
        """Up to ``max_bytes`` of plaintext (b"" at the end of the stream) and the arrival
        of the record it came in."""
        self.stamped.sock.settimeout(timeout)
        while not self._plain:
            try:
                self._plain = self.obj.read(1 << 20)
                if not self._plain:  # close_notify
                    return b"", None
            except ssl.SSLWantReadError:  # a record with no data (a session ticket)
                self._flush()
                self._plain_at = self._record()
                if self._plain_at is None:
                    return b"", None
        data, self._plain = self._plain[:max_bytes], self._plain[max_bytes:]
        return data, self._plain_at


class _TimedSocket(httpcore2.NetworkStream):
    """Stamps a request's wire times at the client's socket, by the kernel's own stamps
    (``tests/kstamps.py``), so a client waiting for a CPU after the bytes arrived does
    not count it: the departure of its first send and the arrival of the segment that
    brought the first text (on TLS, the segment that completed that text's record)."""

    def __init__(self, inner: Any, timings: "_TimingTransport",
                 tls: _StampedTLS | None = None) -> None:
        self.inner = inner
        self.timings = timings
        self._tail = b""
        self._reading = False
        self.tls = tls
        sock = inner.get_extra_info("socket")
        assert type(sock) is socket.socket, f"not a TCP socket: {sock!r}"
        self.sock = sock
        self.stamped = StampedSocket(sock) if tls is None else tls.stamped

    @property
    def timing(self) -> dict[str, float]:
        """The timing of the request the calling thread is making (a pooled
        connection serves one thread's request at a time, but many threads in turn)."""
        return self.timings.timing

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if self._reading:  # a new request on a kept-alive connection: a fresh search
            self._tail = b""
            self._reading = False
        first = "sent" not in self.timing and len(buffer) > 0
        if first:  # the connection that carries the request (a kept-alive one or new)
            self.timing["port"] = self.sock.getsockname()[1]
        if self.tls is not None:
            with map_exceptions(
                    {socket.timeout: httpcore2.WriteTimeout, OSError: httpcore2.WriteError}):
                stamp = self.tls.write(buffer, timeout)
        else:
            self.inner.write(buffer, timeout)
            # every write's stamp is taken off the error queue: a stamp left there
            # makes the idle socket poll as broken, and the pool would not reuse it
            stamp = self.stamped.sent(len(buffer))
        if first and stamp is not None:
            self.timing["sent"] = stamp / 1e9

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self._reading = True
        looking = "sent" in self.timing and "first_text" not in self.timing
        if self.tls is not None:
            with map_exceptions(
                    {socket.timeout: httpcore2.ReadTimeout, OSError: httpcore2.ReadError}):
                data, at = self.tls.read(max_bytes, timeout)
            if looking:
                window = self._tail + data
                if FIRST_TEXT.search(window):
                    assert at is not None, "the kernel did not stamp the segment"
                    self.timing["first_text"] = at / 1e9
                self._tail = window[-64:]
            return data
        if not looking:
            return self.inner.read(max_bytes, timeout)
        peeked, _ = self.stamped.peek(max_bytes)
        m = FIRST_TEXT.search(self._tail + peeked)
        if m and m.end() > len(self._tail):  # the segment holding the text's first bytes
            _, at = self.stamped.peek(m.end() - len(self._tail))
            assert at is not None, "the kernel did not stamp the segment"
            self.timing["first_text"] = at / 1e9
        self._tail = (self._tail + peeked)[-64:]
        return self.inner.read(len(peeked), timeout) if peeked else b""

    def close(self) -> None:
        self.inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> Any:
        with map_exceptions(
                {socket.timeout: httpcore2.ConnectTimeout, OSError: httpcore2.ConnectError}):
            tls = _StampedTLS(self.stamped, ssl_context, server_hostname, timeout)
        return _TimedSocket(self.inner, self.timings, tls)

    def get_extra_info(self, info: str) -> Any:
        if info == "ssl_object" and self.tls is not None:
            return self.tls.obj
        return self.inner.get_extra_info(info)


class _TimedBackend(httpcore2.NetworkBackend):
    def __init__(self, timings: "_TimingTransport") -> None:
        self.inner = httpcore2.SyncBackend()
        self.timings = timings

    def connect_tcp(self, *a: Any, **kw: Any) -> httpcore2.NetworkStream:
        return _TimedSocket(self.inner.connect_tcp(*a, **kw), self.timings)

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


class _TimingTransport(httpx2.HTTPTransport):
    """``timing`` is the calling thread's last request's (the sync client does its
    I/O on the thread that asks), reset for each request."""

    def __init__(self, verify: Any = True, keepalive_s: float = 5.0) -> None:
        super().__init__(verify=verify, limits=httpx2.Limits(
            max_connections=100, max_keepalive_connections=20, keepalive_expiry=keepalive_s))
        self._local = threading.local()
        self._pool._network_backend = _TimedBackend(self)

    @property
    def timing(self) -> dict[str, float]:
        t = getattr(self._local, "timing", None)
        if t is None:
            t = self._local.timing = {}
        return t

    def handle_request(self, request: Any) -> Any:
        self.timing.clear()
        return super().handle_request(request)


class TimedClient:
    """The official openai client, timing its requests at its own sockets.

    ``ttft`` is from the departure of the request's first bytes to the arrival of the
    segment that brought the first generated text, by the kernel's stamps on the
    client's socket: the client's view of the wire, without the SDK's request building
    and response parsing (``ttft_sdk`` includes them) and without the client's own
    waits for a CPU."""

    def __init__(self, base_url: str, verify: Any = True, keepalive_s: float = 5.0,
                 **kw: Any) -> None:
        """``verify``: an ``ssl.SSLContext`` (or CA file) for an HTTPS server's
        certificate; ``keepalive_s``: how long an idle connection is kept (httpx's 5 s
        by default)."""
        self.transport = _TimingTransport(verify, keepalive_s)
        self._last_sent = 0.0
        self.http = httpx2.Client(transport=self.transport, timeout=httpx2.Timeout(60.0),
                                  event_hooks={"request": [self._hook]})
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-test",
                                    http_client=self.http, max_retries=0, **kw)

    def _hook(self, request: Any) -> None:
        self._last_sent = time.monotonic()

    def _wire_ttft(self) -> float | None:
        t = self.transport.timing
        return t["first_text"] - t["sent"] if "first_text" in t and "sent" in t else None

    def chat(self, stream: bool, max_tokens: int, usage: bool = True,
             content: str = "Hello there, tiny model", model: str = "tiny-gpt"
             ) -> dict[str, Any]:
        """One chat request; returns id, usage, chunk count and client-side TTFT."""
        kw: dict[str, Any] = {}
        if stream and usage:
            kw["stream_options"] = {"include_usage": True}
        resp = self.client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens, stream=stream, **kw)
        if not stream:
            done = time.monotonic()
            return {"id": resp.id, "output_tokens": resp.usage.completion_tokens,
                    "input_tokens": resp.usage.prompt_tokens, "ttft": self._wire_ttft(),
                    "ttft_sdk": done - self._last_sent,
                    "client_port": self.transport.timing.get("port")}
        sent = self._last_sent
        first = None
        out = {"id": None, "text_chunks": 0, "output_tokens": None, "input_tokens": None}
        for ch in resp:
            out["id"] = ch.id
            if ch.choices and ch.choices[0].delta.content:
                out["text_chunks"] += 1
                if first is None:
                    first = time.monotonic()
            if ch.usage:
                out["output_tokens"] = ch.usage.completion_tokens
                out["input_tokens"] = ch.usage.prompt_tokens
        out["ttft"] = self._wire_ttft()
        out["ttft_sdk"] = (first - sent) if first else None
        out["client_port"] = self.transport.timing.get("port")
        return out


class CLIRun:
    """`tokentrace run` as its own process (as users run it): spans from its JSONL."""

    def __init__(self, args: list[str], jsonl: str) -> None:
        self.args = args
        self.jsonl = jsonl
        self.stderr = ""
        self.returncode: int | None = None
        self.pid = 0  # the tokentrace process

    @property
    def spans(self) -> list[dict[str, Any]]:
        with open(self.jsonl) as f:
            return [json.loads(line) for line in f]


@contextmanager
def traced_cli(args: list[str], jsonl: str, timeout: float = 60.0) -> Iterator[CLIRun]:
    """Start `tokentrace run ARGS --jsonl JSONL --quiet`, wait for 'attached', run the
    block, then stop it with SIGINT as a user would and wait for it to flush."""
    import signal
    import subprocess
    import sys

    run = CLIRun(args, jsonl)
    proc = subprocess.Popen([sys.executable, "-m", "tracer", "run", *args, "--jsonl", jsonl,
                             "--quiet", "--sched-idle"], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    run.pid = proc.pid
    lines = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError("tokentrace run exited before attaching:\n" + "".join(lines))
        lines.append(line)
        if "attached" in line:
            break
    # the rest through the same text stream: readline() may have read past 'attached'
    # (the TLS line follows it at once), and communicate() reads the pipe's descriptor
    # itself, which would drop what was read ahead
    rest: list[str] = []
    reader = threading.Thread(target=lambda: rest.append(proc.stderr.read()), daemon=True)
    reader.start()
    try:
        yield run
    finally:
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=timeout)
        reader.join(timeout)
        run.stderr = "".join(lines) + "".join(rest)
        run.returncode = proc.returncode
