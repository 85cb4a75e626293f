"""Finished requests: what the correlator hands to every exporter.

A ``RequestRecord`` is one request/response exchange as the traced process saw it,
with monotonic-ns timestamps (the exporters convert them with the capture's clock
sync). It holds no secrets: request headers are kept by name from ``SAFE_HEADERS``,
and the API key only as a salted hash (``tenant``).

The tenant hash is keyed by a per-deployment salt (``--tenant-salt``, else a random
one that the capture header keeps), so tenants cannot be linked across deployments.
It is computed from the key's *mask* (``mask_token``: an HMAC of the key, as long as
the key), which is what captures store in place of the key: a replay of a masked
capture then finds the same tenants as the live run without ever holding a key.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from protocols.grpc import SERVER_ERROR_CODES, Call
from protocols.openai import LLMRequest, LLMResponse
from protocols.tls import TlsSession
from tracer.events.schema import ProcessInfo
from tracer.privacy import mask_token, token_span

SAFE_HEADERS = frozenset({
    "host", "user-agent", "content-type", "content-length", "accept", "traceparent",
    "tracestate", "x-request-id", "openai-organization", "openai-project",
})

TENANT_HEADERS = ("authorization", "api-key", "x-api-key")
TENANT_SALT = b"tokentrace-tenant-v1"  # captures from before per-deployment salts


def _bytes(text: str) -> bytes:
    try:
        return text.encode("latin-1")  # HTTP/1 header values were decoded as latin-1
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace")


def tenant_of(headers: dict[str, str], salt: bytes | None = None, masked: bool = False
              ) -> str | None:
    """A stable, non-reversible tenant id from the request's API key header.

    ``salt``: the deployment's tenant salt (None: the fixed salt of older captures).
    ``masked``: the header values are already masks (a replay of a masked capture)."""
    for name in TENANT_HEADERS:
        v = headers.get(name)
        if not v:
            continue
        if salt is None:
            token = v.split(None, 1)[-1].encode()
            return hashlib.sha256(TENANT_SALT + token).hexdigest()[:16]
        raw = _bytes(v)
        a, b = token_span(raw)
        token = raw[a:b]
        if masked and token and token.count(b"*") == len(token):
            return None  # masked without its key (split over two captured reads)
        m = token if masked else mask_token(token, salt)
        return hashlib.sha256(salt + m).hexdigest()[:16]
    return None


@dataclass
class NetTiming:
    """A request as its client sees it: when its bytes reached the server's socket and
    when the response's bytes left it (``tracer.correlate.nettiming``).

    ``timing`` is ``socket`` when both ends were measured, else ``syscall`` (the span
    keeps the server's syscall times) with ``reason``. ``departures`` maps writes the
    client's view depends on (by their syscall exit) to when their bytes left; a write
    not in it left as it returned (``left`` reads it so)."""

    timing: str
    reason: str = ""
    arrival_ns: int | None = None  # the request's first bytes reached the socket
    llm_arrival_ns: int | None = None  # the same for ``llm_start_ns`` (gRPC message)
    estab_ns: int | None = None  # a new connection's handshake completed
    accept_ns: int | None = None  # ...and accept() returned it
    departures: dict[int, int] = field(default_factory=dict)
    send_hold_ns: int = 0  # the longest wait of a response write's bytes in the kernel
    send_hold_cause: str | None = None  # nagle, cwnd, rwnd, cork
    # how much later than its departure a write's bytes may have left, at most, where
    # an ACK the probe did not see hides when (bpf/netwait.c, UNSEEN); 0: all known
    unseen_ns: int = 0
    # TLS: plaintext writes with no ciphertext write found to carry them (their own
    # times kept as their departure)
    tls_unmapped: int = 0

    def left(self, ts: int | None) -> int | None:
        """When the bytes of the write that returned at ``ts`` left (``ts`` if unknown)."""
        return None if ts is None else self.departures.get(ts, ts)


# the error of a request open when a --duty-cycle window closed (tracer/duty.py)
DUTY_CYCLE_CUT = "the duty cycle's window closed before the response completed"


@dataclass
class RequestRecord:
    pid: int
    fd: int
    conn_id: int
    exchange: int
    role: str  # "server" (the traced process answered) or "client"
    protocol: str = "http/1.1"
    method: str = ""
    target: str = ""
    http_version: str = ""
    status: int | None = None
    request_headers: dict[str, str] = field(default_factory=dict)
    response_headers: dict[str, str] = field(default_factory=dict)
    tenant: str | None = None
    family: int = 0
    local_addr: str = ""
    local_port: int = 0
    peer_addr: str = ""
    peer_port: int = 0
    tids: list[int] = field(default_factory=list)
    start_ns: int = 0  # first request byte
    # its stream offset in the connection's inbound bytes, where the parser knows it
    # (HTTP/2: the stream's HEADERS frame): which of a read's arrivals is the request's
    start_off: int | None = None
    request_end_ns: int | None = None
    response_start_ns: int | None = None
    end_ns: int = 0  # last response byte (or when the exchange was given up)
    request_bytes: int = 0
    response_bytes: int = 0
    request_incomplete: bool = False
    response_incomplete: bool = False
    error: str | None = None  # why the exchange failed, if it did
    llm_request: LLMRequest | None = None
    llm_response: LLMResponse | None = None
    process: ProcessInfo | None = None
    rpc: Call | None = None  # the HTTP/2 stream (gRPC call) this record came from
    # when the inference request itself began, if later than start_ns (a gRPC stream
    # opened before its first request message): TTFT counts from here
    llm_start_ns: int | None = None
    # filled by the GPU correlation: attribute name suffix -> value
    gpu: dict[str, Any] = field(default_factory=dict)
    children: list["ChildSpan"] = field(default_factory=list)
    net: NetTiming | None = None  # the client's view (tracer.correlate.nettiming)
    tls: TlsSession | None = None  # came over TLS, read through the TLS library's probes
    # its share of the launch-site stacks (tracer.correlate.stacks.Flame), if sampled
    flame: Any = None
    # traced under `run --duty-cycle F` (tracer/duty.py): one of the requests seen while
    # the probes were in, F of the time (0: every request was followed)
    duty_cycle: float = 0.0

    @cached_property
    def key(self) -> tuple[int, int, int, int]:
        """(pid, fd, conn_id, exchange): fixed once the record exists (looked up often)."""
        return (self.pid, self.fd, self.conn_id, self.exchange)

    @property
    def cut_by_duty_cycle(self) -> bool:
        """Ended by a ``--duty-cycle`` window's close, not by the server: a sample's
        artefact, left out of the metrics (a failure there would be the tracer's)."""
        return self.error == DUTY_CYCLE_CUT

    @property
    def is_llm(self) -> bool:
        return self.llm_request is not None

    @property
    def ttft_ns(self) -> int | None:
        r = self.llm_response
        if r is None or r.first_token_ts is None:
            return None
        return r.first_token_ts - (self.llm_start_ns or self.start_ns)

    @property
    def first_chunk_ns(self) -> int | None:
        r = self.llm_response
        if r is None or r.first_chunk_ts is None:
            return None
        return r.first_chunk_ts - (self.llm_start_ns or self.start_ns)

    @property
    def tpot_ns(self) -> float | None:
        """Mean gap between text-carrying chunks after the first one."""
        r = self.llm_response
        if r is None or len(r.token_ts) < 2:
            return None
        return (r.token_ts[-1] - r.token_ts[0]) / (len(r.token_ts) - 1)

    # ---- the client's view: socket times where measured, else the syscall ones -------

    @property
    def socket_timed(self) -> bool:
        return self.net is not None and self.net.timing == "socket"

    @property
    def client_start_ns(self) -> int:
        """When the request's first bytes reached the server's socket."""
        n = self.net
        return n.arrival_ns if n is not None and n.arrival_ns is not None else self.start_ns

    @property
    def client_end_ns(self) -> int:
        """When the response's last bytes left the server's socket."""
        end = self.net.left(self.end_ns) if self.net is not None else self.end_ns
        return max(end or self.end_ns, self.client_start_ns)

    def _client_from(self) -> int:
        n = self.net
        if n is None or n.timing != "socket":
            return self.llm_start_ns or self.start_ns
        return (n.llm_arrival_ns if self.llm_start_ns else n.arrival_ns) or self.start_ns

    @property
    def client_ttft_ns(self) -> int | None:
        """Time to first token as the client sees it (socket arrival to departure)."""
        r = self.llm_response
        if r is None or r.first_token_ts is None:
            return None
        if self.net is None:
            return self.ttft_ns
        return self.net.left(r.first_token_ts) - self._client_from()  # type: ignore[operator]

    @property
    def client_first_chunk_ns(self) -> int | None:
        r = self.llm_response
        if r is None or r.first_chunk_ts is None:
            return None
        if self.net is None:
            return self.first_chunk_ns
        return self.net.left(r.first_chunk_ts) - self._client_from()  # type: ignore[operator]

    @property
    def client_token_ts(self) -> list[int]:
        r = self.llm_response
        if r is None:
            return []
        if self.net is None:
            return list(r.token_ts)
        return [self.net.left(t) for t in r.token_ts]  # type: ignore[misc]

    @property
    def client_tpot_ns(self) -> float | None:
        ts = self.client_token_ts
        if len(ts) < 2:
            return None
        return (ts[-1] - ts[0]) / (len(ts) - 1)

    @property
    def socket_wait_ns(self) -> int | None:
        """Arrival of the request's bytes to the server's read of them."""
        n = self.net
        if n is None or n.timing != "socket" or n.arrival_ns is None:
            return None
        return max(0, self.start_ns - n.arrival_ns)

    @property
    def failed(self) -> bool:
        if self.error:
            return True
        if self.rpc is not None and self.rpc.is_grpc:
            code = self.rpc.grpc_status  # unknown (undecodable trailers): not a failure
            return code is not None and (code in SERVER_ERROR_CODES or
                                         (self.role == "client" and code != 0))
        if self.status is None:
            return True
        return self.status >= 500 or (self.role == "client" and self.status >= 400)


@dataclass
class ChildSpan:
    """A phase of a request (queue, prefill, decode) as its own span."""

    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
