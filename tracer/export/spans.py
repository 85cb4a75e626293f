"""Finished requests to OpenTelemetry spans.

One span per request, on the OpenTelemetry SDK, with the request's own start and end
times. Names and attributes follow the GenAI semantic conventions where a span
attribute exists (``gen_ai.*``), the HTTP/network conventions for the transport, and
``tokentrace.*`` for the rest. ``gen_ai.server.time_to_first_token`` and friends are
metric names in the conventions, so TTFT and TPOT live in ``tokentrace.*`` here.

Span and trace ids are derived from the capture id and the request's identity, so a
replay of a capture reproduces the live run's ids. An incoming ``traceparent``
continues the caller's trace. Prompt and completion text is exported only when the
records carry it (the user opted in).
"""

from __future__ import annotations

import hashlib
import re
import socket as pysocket
import threading
import uuid
from typing import Any, Iterable

from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import tracer
from tracer.correlate.records import ChildSpan, RequestRecord
from tracer.events.schema import ProcessInfo
from tracer.export.context import ExportContext
from tracer.export.identity import identity_attributes, node_attributes
from tracer.privacy import redact_args

NS = 1e-9
_PROPAGATOR = TraceContextTextMapPropagator()


class PrimedIdGenerator(IdGenerator):
    """Hands out the ids set by ``prime`` once, random ids otherwise."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._random = RandomIdGenerator()

    def prime(self, trace_id: int | None, span_id: int) -> None:
        self._local.trace_id = trace_id
        self._local.span_id = span_id

    def generate_span_id(self) -> int:
        v = getattr(self._local, "span_id", None)
        self._local.span_id = None
        return v or self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        v = getattr(self._local, "trace_id", None)
        self._local.trace_id = None
        return v or self._random.generate_trace_id()


def derived_id(bits: int, *parts: object) -> int:
    """A non-zero id of ``bits`` bits from a hash of ``parts``."""
    h = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=bits // 8).digest()
    return int.from_bytes(h, "big") or 1


_PYTHON = re.compile(r"python[0-9.]*$")


def service_name_for(info: ProcessInfo) -> str:
    """A sensible service name for a process: the module or script an interpreter runs
    (``python -m vllm.entrypoints...`` -> ``vllm.entrypoints...``), else the program."""
    args = list(info.cmdline)
    prog = (args[0] if args else info.exe).rsplit("/", 1)[-1]
    if _PYTHON.match(prog):
        rest = args[1:]
        while rest:
            a = rest.pop(0)
            if a == "-m" and rest:
                return rest[0]
            if a in ("-c",):
                break
            if a.startswith("-"):
                if a in ("-W", "-X") and rest:
                    rest.pop(0)
                continue
            return a.rsplit("/", 1)[-1].removesuffix(".py")
    return prog or info.comm


def resource_for(ctx: ExportContext, pid: int) -> Resource:
    """The resource (who emitted the span) for a traced process."""
    info = ctx.processes.get(pid)
    attrs = _emitter_attributes(ctx, "tokentrace", pid)
    attrs["process.pid"] = pid
    name = ctx.service_name
    if info is not None:
        if info.exe:
            attrs["process.executable.path"] = info.exe
            attrs["process.executable.name"] = info.exe.rsplit("/", 1)[-1]
        if info.cmdline and ctx.capture_cmdline:  # keys are passed on command lines
            attrs["process.command_line"] = " ".join(redact_args(info.cmdline))[:1024]
        if info.ppid:
            attrs["process.parent_pid"] = info.ppid
        name = name or service_name_for(info)
    ident = identity_attributes(ctx, pid, info)  # container.id, k8s.* (pod labels name it)
    label_name = ident.pop("service.name", None)
    attrs.update(ident)
    attrs["service.name"] = ctx.service_name or label_name or name or f"pid-{pid}"
    attrs.update(ctx.extra_resource.get(pid, {}))
    return Resource.create(attrs)


def agent_resource(ctx: ExportContext) -> Resource:
    """The resource for the agent's own telemetry (its health metrics): the host and,
    in a DaemonSet, the node, under ``service.name`` ``tokentrace``."""
    attrs = _emitter_attributes(ctx, "tokentrace-agent")
    attrs["service.name"] = "tokentrace"
    attrs.update(node_attributes(ctx))
    return Resource.create(attrs)


def _emitter_attributes(ctx: ExportContext, kind: str, *key: Any) -> dict[str, Any]:
    """What every resource here carries: the host, the SDK, and a ``service.instance.id``
    from ``kind``, the host, ``key`` and the capture, stable across a replay of the same
    capture (the SDK would pick a random one)."""
    host = ctx.host or pysocket.gethostname()
    name = ":".join(str(part) for part in (kind, host, *key, ctx.capture_id))
    return {
        "host.name": host,
        "service.instance.id": str(uuid.uuid5(uuid.NAMESPACE_URL, name)),
        "telemetry.sdk.name": "tokentrace",
        "telemetry.sdk.version": tracer.__version__,
    }


def _seconds(ns: int | float | None) -> float | None:
    return None if ns is None else ns * NS


def span_name(rec: RequestRecord) -> str:
    if rec.llm_request is not None:
        model = rec.llm_request.model or (rec.llm_response.model if rec.llm_response else None)
        return f"{rec.llm_request.operation} {model}" if model else rec.llm_request.operation
    if rec.rpc is not None and rec.rpc.is_grpc:
        svc, meth = rec.rpc.service_method
        if svc and meth:
            return f"{svc}/{meth}"  # the OpenTelemetry RPC span name
    return f"{rec.method} {rec.target.split('?', 1)[0]}".rstrip() if rec.method else "HTTP"


def span_attributes(rec: RequestRecord) -> dict[str, Any]:
    """Every attribute of a request span (None values are left out)."""
    a: dict[str, Any] = {}
    q, r = rec.llm_request, rec.llm_response
    if q is not None:
        a["gen_ai.operation.name"] = q.operation
        a["gen_ai.request.model"] = q.model
        a["gen_ai.request.max_tokens"] = q.max_tokens
        a["gen_ai.request.temperature"] = q.temperature
        a["gen_ai.request.top_p"] = q.top_p
        a["gen_ai.request.choice.count"] = q.n
        a["tokentrace.request.stream"] = q.stream
        a["tokentrace.api"] = getattr(q, "api", "openai")
        if q.prompt is not None:
            a["tokentrace.prompt.text"] = q.prompt
    if r is not None:
        a["gen_ai.response.model"] = r.model
        a["gen_ai.response.id"] = r.response_id
        if r.finish_reasons:
            a["gen_ai.response.finish_reasons"] = list(r.finish_reasons)
        a["gen_ai.usage.input_tokens"] = r.input_tokens
        a["gen_ai.usage.output_tokens"] = r.output_tokens
        a["tokentrace.usage.source"] = r.usage_source
        # as the client sees them: from the request's arrival at the socket to the
        # departure of the token's bytes (the syscall times where those were not seen)
        a["gen_ai.response.time_to_first_chunk"] = _seconds(rec.client_first_chunk_ns)
        a["tokentrace.time_to_first_token"] = _seconds(rec.client_ttft_ns)
        a["tokentrace.time_per_output_token"] = _seconds(rec.client_tpot_ns)
        a["tokentrace.server.time_to_first_token"] = _seconds(rec.ttft_ns)
        tokens = rec.client_token_ts
        if len(tokens) > 1:
            gaps = [b - x for x, b in zip(tokens, tokens[1:])]
            a["tokentrace.inter_token_gap.max"] = max(gaps) * NS
            a["tokentrace.inter_token_gap.p50"] = sorted(gaps)[len(gaps) // 2] * NS
        a["tokentrace.response.chunks"] = r.chunks if r.streamed else None
        if r.error_type:
            a["error.type"] = r.error_type
            a["tokentrace.error.message"] = r.error_message
        if r.text is not None:
            a["tokentrace.completion.text"] = r.text
    if rec.rpc is not None:
        a.update(rpc_attributes(rec))
    a.update(network_attributes(rec))
    a.update(tls_attributes(rec))
    a["http.request.method"] = rec.method or None
    a["url.path"] = rec.target.split("?", 1)[0] or None
    if rec.rpc is None or not rec.rpc.is_grpc:
        a["url.scheme"] = ("https" if rec.tls is not None else "http") if rec.method else None
    a["http.response.status_code"] = rec.status
    a["network.protocol.name"] = "http"
    a["network.protocol.version"] = rec.http_version or None
    a["network.transport"] = {1: "unix", 2: "tcp", 10: "tcp"}.get(rec.family)
    a["network.type"] = {2: "ipv4", 10: "ipv6"}.get(rec.family)
    if rec.role == "server":
        a["server.address"] = rec.local_addr or None
        a["server.port"] = rec.local_port or None
        a["client.address"] = rec.peer_addr or None
        a["client.port"] = rec.peer_port or None
    else:
        a["server.address"] = rec.peer_addr or rec.request_headers.get("host")
        a["server.port"] = rec.peer_port or None
    a["network.peer.address"] = rec.peer_addr or None
    a["network.peer.port"] = rec.peer_port or None
    a["user_agent.original"] = rec.request_headers.get("user-agent")
    a["http.request.body.size"] = rec.request_bytes
    a["http.response.body.size"] = rec.response_bytes
    a["process.pid"] = rec.pid
    a["thread.id"] = rec.tids[0] if rec.tids else None
    a["tokentrace.thread_ids"] = list(rec.tids) if rec.tids else None
    a["tokentrace.tenant"] = rec.tenant
    if rec.duty_cycle:  # a sample: counts scale by 1 / this
        a["tokentrace.duty_cycle"] = rec.duty_cycle
    if rec.request_incomplete:
        a["tokentrace.request.incomplete"] = True
    if rec.response_incomplete:
        a["tokentrace.response.incomplete"] = True
    if rec.failed and "error.type" not in a:
        if rec.error:
            a["error.type"] = "incomplete" if rec.response_incomplete else "aborted"
        elif rec.status is not None:
            a["error.type"] = str(rec.status)
    if rec.error:
        a["tokentrace.error.message"] = rec.error
    for k, v in rec.gpu.items():
        a[f"tokentrace.{k}"] = v
    return {k: v for k, v in a.items() if v is not None}


def tls_attributes(rec: RequestRecord) -> dict[str, Any]:
    """OpenTelemetry ``tls.*`` of a request that came over TLS (read through the TLS
    library's probes): ``tls.protocol.name`` always, the rest where the cleartext
    handshake was seen (a connection opened before attach has none of it)."""
    t = rec.tls
    if t is None:
        return {}
    return {"tls.established": True, "tls.protocol.name": t.protocol,
            "tls.protocol.version": t.version, "tls.cipher": t.cipher,
            "tls.client.server_name": t.server_name, "tls.next_protocol": t.alpn}
def launch_sites(stacks: list[Any], top: int = 3) -> list[str]:
    """The request's busiest launch sites: innermost Python frame (or native, for a
    process without Python) and kernel, with their share of its launches."""
    by_site: dict[str, float] = {}
    for frames, calls, _t, _s in stacks:
        caller = next((f for f in reversed(frames) if f[0] == "py"), None) or next(
            (f for f in reversed(frames) if f[0] == "native"), ("", "?", "", 0))
        where = (f"{caller[1]} ({caller[2].rsplit('/', 1)[-1]}:{caller[3]})"
                 if caller[0] == "py" else caller[1])
        site = f"{where} -> {frames[-1][1]}"
        by_site[site] = by_site.get(site, 0.0) + calls
    total = sum(by_site.values()) or 1.0
    best = sorted(by_site.items(), key=lambda kv: -kv[1])[:top]
    return [f"{site}: {n / total:.0%}" for site, n in best]


def network_attributes(rec: RequestRecord) -> dict[str, Any]:
    """``tokentrace.network.*``: how the request was timed and what the kernel held."""
    n = rec.net
    if n is None:
        return {}
    a: dict[str, Any] = {"tokentrace.network.timing": n.timing,
                         "tokentrace.server.duration": _seconds(rec.end_ns - rec.start_ns)}
    if n.timing != "socket":
        a["tokentrace.network.timing_reason"] = n.reason or None
        return a
    a["tokentrace.network.socket_wait"] = _seconds(rec.socket_wait_ns)
    if n.estab_ns is not None:
        # a new connection: handshake done to accept() (the listen backlog)
        a["tokentrace.network.accept_wait"] = (
            _seconds(max(0, n.accept_ns - n.estab_ns)) if n.accept_ns else None)
    a["tokentrace.network.send_hold"] = _seconds(n.send_hold_ns)
    if n.send_hold_ns:
        a["tokentrace.network.send_hold.cause"] = n.send_hold_cause
    if n.unseen_ns:  # the departures are the earliest possible; this much later at most
        a["tokentrace.network.departure_unknown"] = _seconds(n.unseen_ns)
    if n.tls_unmapped:  # their departure is the TLS library's return, not the socket's
        a["tokentrace.network.tls_unmapped_writes"] = n.tls_unmapped
    return a


def network_events(rec: RequestRecord) -> list[ChildSpan]:
    """What the kernel held, as span events (not child spans: one span per request
    stays one span): ``tokentrace.socket_wait`` at the arrival, ``tokentrace.send_hold``
    at the return of the longest held write, each with its duration."""
    n = rec.net
    if n is None or n.timing != "socket":
        return []
    out = []
    wait = rec.socket_wait_ns
    if wait and n.arrival_ns is not None:
        attrs: dict[str, Any] = {"tokentrace.network.socket_wait": wait * NS}
        if n.estab_ns is not None and n.accept_ns:
            attrs["tokentrace.network.accept_wait"] = max(0, n.accept_ns - n.estab_ns) * NS
        out.append(ChildSpan("tokentrace.socket_wait", n.arrival_ns, rec.start_ns, attrs))
    if n.send_hold_ns:
        held = [(left - ts, ts, left) for ts, left in n.departures.items() if left > ts]
        _, ts, left = max(held)
        out.append(ChildSpan("tokentrace.send_hold", ts, left, {
            "tokentrace.network.send_hold": (left - ts) * NS,
            "tokentrace.network.send_hold.cause": n.send_hold_cause}))
    return out


def rpc_attributes(rec: RequestRecord) -> dict[str, Any]:
    """OpenTelemetry RPC attributes (and ``tokentrace.*`` extras) of an HTTP/2 stream."""
    call = rec.rpc
    assert call is not None
    a: dict[str, Any] = {"tokentrace.http2.stream_id": call.stream_id}
    if call.unknown_header_fields:
        a["tokentrace.http2.unknown_header_fields"] = call.unknown_header_fields
    if not call.is_grpc:
        return a
    svc, meth = call.service_method
    a["rpc.system"] = "grpc"
    a["rpc.service"] = svc
    a["rpc.method"] = meth
    a["rpc.grpc.status_code"] = call.grpc_status
    if call.grpc_status:
        a["tokentrace.grpc.status_message"] = call.grpc_message
    a["tokentrace.grpc.request_messages"] = call.request_messages
    a["tokentrace.grpc.response_messages"] = call.response_messages
    if call.framing_inferred:
        a["tokentrace.grpc.framing_inferred"] = True  # gRPC by its request's framing
    elif call.content_type_unknown:
        a["tokentrace.grpc.content_type_unknown"] = True  # gRPC by its decoded :path
    if call.inferred_path is not None:
        a["tokentrace.grpc.method_inferred"] = True  # named by its messages (KServe)
    if call.trailers_only:
        a["tokentrace.grpc.trailers_only"] = True
    if call.reset_code is not None:
        a["tokentrace.http2.reset_code"] = call.reset_code
    q = rec.llm_request
    for name in ("model_version", "request_id"):
        a[f"tokentrace.kserve.{name}"] = getattr(q, name, None)
    if getattr(q, "inputs", None):
        a["tokentrace.kserve.inputs"] = list(q.inputs)  # type: ignore[union-attr]
    if getattr(q, "requests", 0) > 1:
        a["tokentrace.kserve.requests"] = q.requests  # type: ignore[union-attr]
    return a


class SpanBuilder:
    """A record sink that creates SDK spans and hands them to ``processors``."""

    def __init__(self, ctx: ExportContext, processors: Iterable[SpanProcessor]) -> None:
        self.ctx = ctx
        self.processors = list(processors)
        self._providers: dict[int, tuple[TracerProvider, PrimedIdGenerator]] = {}

    def _tracer_for(self, pid: int) -> tuple[otel_trace.Tracer, PrimedIdGenerator]:
        entry = self._providers.get(pid)
        if entry is None:
            ids = PrimedIdGenerator()
            provider = TracerProvider(resource=resource_for(self.ctx, pid), id_generator=ids,
                                      shutdown_on_exit=False)
            for p in self.processors:
                provider.add_span_processor(p)
            entry = (provider, ids)
            self._providers[pid] = entry
        return entry[0].get_tracer("tokentrace", tracer.__version__), entry[1]

    def wall(self, mono_ns: int) -> int:
        return mono_ns + self.ctx.clock_offset_ns

    def on_record(self, rec: RequestRecord) -> None:
        tr, ids = self._tracer_for(rec.pid)
        parent = None
        if "traceparent" in rec.request_headers:
            parent = _PROPAGATOR.extract(carrier=rec.request_headers)
        parent_span = otel_trace.get_current_span(parent) if parent is not None else None
        has_parent = parent_span is not None and parent_span.get_span_context().is_valid
        ident = (self.ctx.capture_id, rec.pid, rec.fd, rec.conn_id, rec.exchange)
        ids.prime(None if has_parent else derived_id(128, *ident), derived_id(64, *ident))
        kind = SpanKind.SERVER if rec.role == "server" else SpanKind.CLIENT
        span = tr.start_span(span_name(rec), context=parent if has_parent else None, kind=kind,
                             start_time=self.wall(rec.client_start_ns),
                             attributes=span_attributes(rec))
        if rec.flame and self.ctx.flame_resolver is not None:
            self._flame(span, rec)
        r = rec.llm_response
        ttft = rec.client_ttft_ns
        if r is not None and r.first_token_ts is not None and ttft is not None:
            span.add_event("tokentrace.first_token",
                           timestamp=self.wall(rec.net.left(r.first_token_ts) or 0
                                               if rec.net else r.first_token_ts),
                           attributes={"tokentrace.time_to_first_token": ttft * NS})
        if rec.failed:
            desc = rec.error or (r.error_message if r and r.error_message else None)
            if rec.rpc is not None and rec.rpc.grpc_status is not None:
                desc = desc or rec.rpc.grpc_message or f"gRPC {rec.rpc.grpc_status}"
            span.set_status(Status(StatusCode.ERROR, desc or f"HTTP {rec.status}"))
        child_ctx = otel_trace.set_span_in_context(span)
        for ev in network_events(rec):
            span.add_event(ev.name, timestamp=self.wall(ev.start_ns), attributes=ev.attributes)
        for i, child in enumerate(rec.children):
            ids.prime(None, derived_id(64, *ident, "child", i))
            cs = tr.start_span(child.name, context=child_ctx, kind=SpanKind.INTERNAL,
                               start_time=self.wall(child.start_ns),
                               attributes={k: v for k, v in child.attributes.items()
                                           if v is not None})
            cs.end(end_time=self.wall(child.end_ns))
        span.end(end_time=self.wall(rec.client_end_ns))

    def _flame(self, span: Any, rec: RequestRecord) -> None:
        """The request's launch-site stacks: a summary on the span, the command that
        draws them, and (for the JSONL exporter) the stacks themselves."""
        from tracer.correlate.stacks import to_json

        stacks = self.ctx.flame_resolver(rec.flame)
        if not stacks:
            return
        sc = span.get_span_context()
        trace_id = format(sc.trace_id, "032x")
        span.set_attribute("tokentrace.gpu.flame.stacks", len(stacks))
        span.set_attribute("tokentrace.gpu.launch_sites", launch_sites(stacks))
        if self.ctx.flame_source:
            span.set_attribute("tokentrace.gpu.flame",
                               f"tokentrace flame {self.ctx.flame_source} --request {trace_id} "
                               f"-o flame-{trace_id[:12]}")
        if self.ctx.flames is not None:
            self.ctx.flames[sc.span_id] = to_json(stacks)

    def close(self) -> None:
        for p in self.processors:
            p.force_flush()
            p.shutdown()
