"""One exported request span (a JSONL object) to one report row.

A row holds only numbers, ids and labels: never prompt or completion text, even when
the spans carry it. An attribute the span does not have stays ``None`` (an empty CSV
cell), never zero: "no GPU work was attributed" and "none was measured" differ.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

# column -> what it means (docs/report.md says the same, at more length)
COLUMNS: dict[str, str] = {
    "trace_id": "trace id (32 hex), as in Jaeger",
    "span_id": "the request span's id (16 hex)",
    "start_time": "first request byte, UTC, ISO 8601",
    "start_time_unix_nano": "the same, in ns since the epoch",
    "service": "service.name of the traced process",
    "pid": "process id of the traced process that answered",
    "model": "model asked for (gen_ai.request.model, else gen_ai.response.model)",
    "tenant": "hashed API key (tokentrace.tenant)",
    "status": "ok or error (the span status)",
    "error": "error.type when the request failed",
    "http_status": "HTTP status code",
    "protocol": "grpc, or http/<version>",
    "api": "LLM API the body was parsed as (openai, kserve, ...)",
    "stream": "whether the response was streamed",
    "prompt_tokens": "gen_ai.usage.input_tokens",
    "output_tokens": "gen_ai.usage.output_tokens",
    "ttft_ms": "time to first token as the client sees it (arrival at the socket to the "
               "token's bytes leaving), ms",
    "tpot_ms": "mean time per output token after the first, ms",
    "e2e_ms": "request bytes' arrival to the last response bytes leaving, ms",
    "server_ttft_ms": "time to first token by the server's syscalls (read to write), ms",
    "socket_wait_ms": "request bytes waiting in the socket before the server read them, ms",
    "accept_wait_ms": "a new connection's wait in the listen backlog (handshake to accept), ms",
    "send_hold_ms": "longest time a response write's bytes were held by the kernel, ms",
    "send_hold_cause": "why: nagle, cwnd, rwnd or cork",
    "departure_unknown_ms": "how much later response bytes may have left than timed, "
                            "where the kernel skipped the probe for an ACK; empty: none",
    "network_timing": "socket (arrival and departure seen) or syscall (server times only)",
    "tls": "TLS version of a request read through the TLS probes (1.2, 1.3; 'tls' when "
           "the handshake was not seen); empty in the clear",
    "gpu_launches": "kernel launches charged to the request (its share)",
    "gpu_graph_launches": "CUDA graph launches charged to the request",
    "gpu_prefill_launches": "of the launches, in prefill",
    "gpu_decode_launches": "of the launches, in decode",
    "gpu_steps": "engine steps the request took part in",
    "memcpy_bytes_h2d": "host-to-device copy bytes charged",
    "memcpy_bytes_d2h": "device-to-host copy bytes charged",
    "memcpy_bytes_d2d": "device-to-device copy bytes charged",
    "memcpy_bytes_other": "other copy bytes charged",
    "gpu_ms": "GPU-time estimate charged to the request, ms",
    "gpu_time_method": "how gpu_ms was estimated",
    "gpu_ms_per_output_token": "gpu_ms / output_tokens",
    "cost_usd": "gpu_ms priced at price_per_gpu_hour, USD",
    "price_per_gpu_hour": "USD per GPU-hour used for cost_usd",
    "price_source": "where the price came from (explicit, default:<gpu>, fallback)",
    "gpu_model": "GPU model the price is for",
    "attribution": "how GPU work was tied to the request",
}

_NUMBERS = {
    "prompt_tokens": "gen_ai.usage.input_tokens",
    "output_tokens": "gen_ai.usage.output_tokens",
    "http_status": "http.response.status_code",
    "pid": "process.pid",
    "gpu_launches": "tokentrace.gpu.kernel_launches",
    "gpu_graph_launches": "tokentrace.gpu.graph_launches",
    "gpu_prefill_launches": "tokentrace.gpu.prefill_launches",
    "gpu_decode_launches": "tokentrace.gpu.decode_launches",
    "gpu_steps": "tokentrace.gpu.steps",
    "memcpy_bytes_h2d": "tokentrace.gpu.memcpy_bytes.h2d",
    "memcpy_bytes_d2h": "tokentrace.gpu.memcpy_bytes.d2h",
    "memcpy_bytes_d2d": "tokentrace.gpu.memcpy_bytes.d2d",
    "memcpy_bytes_other": "tokentrace.gpu.memcpy_bytes.other",
    "gpu_ms": "tokentrace.gpu.time_ms",
    "cost_usd": "tokentrace.cost.usd",
    "price_per_gpu_hour": "tokentrace.cost.price_per_gpu_hour",
}
_SECONDS_AS_MS = {
    "ttft_ms": "tokentrace.time_to_first_token",
    "tpot_ms": "tokentrace.time_per_output_token",
    "server_ttft_ms": "tokentrace.server.time_to_first_token",
    "socket_wait_ms": "tokentrace.network.socket_wait",
    "accept_wait_ms": "tokentrace.network.accept_wait",
    "send_hold_ms": "tokentrace.network.send_hold",
    "departure_unknown_ms": "tokentrace.network.departure_unknown",
}
_LABELS = {
    "service": None,  # from the resource
    "tenant": "tokentrace.tenant",
    "error": "error.type",
    "api": "tokentrace.api",
    "gpu_time_method": "tokentrace.gpu.time_method",
    "price_source": "tokentrace.cost.price_source",
    "gpu_model": "tokentrace.gpu.model",
    "attribution": "tokentrace.gpu.attribution",
    "send_hold_cause": "tokentrace.network.send_hold.cause",
    "network_timing": "tokentrace.network.timing",
}
CHILD_NAMES = frozenset({"queue", "prefill", "decode"})


class RowBuilder:
    """Turns span dicts into rows, counting attribute values of the wrong type."""

    def __init__(self) -> None:
        self.bad_values = 0

    def _number(self, attrs: dict[str, Any], key: str) -> float | int | None:
        v = attrs.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
            self.bad_values += 1
            return None
        return v

    def _label(self, attrs: dict[str, Any], key: str) -> str | None:
        v = attrs.get(key)
        if v is None:
            return None
        if not isinstance(v, (str, int, float)) or isinstance(v, bool):
            self.bad_values += 1
            return None
        return str(v)

    def row(self, span: dict[str, Any]) -> dict[str, Any]:
        """The report row of a request span (see ``COLUMNS``)."""
        a: dict[str, Any] = span["attributes"]
        r: dict[str, Any] = dict.fromkeys(COLUMNS)
        r["trace_id"] = span.get("trace_id")
        r["span_id"] = span.get("span_id")
        start, end = span.get("start_time_unix_nano"), span.get("end_time_unix_nano")
        if isinstance(start, int) and not isinstance(start, bool) and start > 0:
            r["start_time_unix_nano"] = start
            r["start_time"] = datetime.fromtimestamp(start / 1e9, tz=timezone.utc) \
                .isoformat(timespec="milliseconds")
            if isinstance(end, int) and not isinstance(end, bool) and end >= start:
                r["e2e_ms"] = round((end - start) / 1e6, 3)
        for col, key in _NUMBERS.items():
            r[col] = self._number(a, key)
        for col, key in _SECONDS_AS_MS.items():
            v = self._number(a, key)
            r[col] = None if v is None else round(v * 1e3, 3)
        for col, key in _LABELS.items():
            if key is not None:
                r[col] = self._label(a, key)
        resource = span.get("resource")
        if isinstance(resource, dict):
            r["service"] = self._label(resource, "service.name")
        r["model"] = self._label(a, "gen_ai.request.model") or \
            self._label(a, "gen_ai.response.model")
        r["status"] = "error" if span.get("status") == "ERROR" else "ok"
        if a.get("rpc.system") == "grpc":
            r["protocol"] = "grpc"
        elif a.get("network.protocol.name"):
            version = a.get("network.protocol.version")
            r["protocol"] = f"{a['network.protocol.name']}/{version}" if version \
                else str(a["network.protocol.name"])
        if a.get("tls.protocol.name") is not None:
            r["tls"] = self._label(a, "tls.protocol.version") or \
                self._label(a, "tls.protocol.name")
        stream = a.get("tokentrace.request.stream")
        r["stream"] = stream if isinstance(stream, bool) else None
        if r["gpu_ms"] is not None and r["output_tokens"]:
            r["gpu_ms_per_output_token"] = round(r["gpu_ms"] / r["output_tokens"], 6)
        return r


def is_request_span(span: dict[str, Any]) -> bool:
    """Request spans are SERVER or CLIENT spans; queue/prefill/decode phases are
    INTERNAL children of them. (A request span may have a parent: the caller's
    ``traceparent``.)"""
    kind = span.get("kind")
    if kind is not None:
        return kind in ("SERVER", "CLIENT")
    return not (span.get("parent_span_id") and span.get("name") in CHILD_NAMES)
