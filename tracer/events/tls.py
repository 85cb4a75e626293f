"""Typed events of the TLS probes (bpf/tls.c, tracer/probes/tls.py).

``TlsEvent`` records come from the kernel: an SSL object was tied to its socket
(``bind``), completed its handshake (``established``) or was freed (``free``, with
``failed`` when its handshake began and never completed). The plaintext itself comes as
ordinary ``DataEvent``s flagged TLS (``tls_plain``), on the socket the object was tied
to. ``TlsLibrary`` is written by the capture for each TLS library found in a traced
process: what it is, and whether it was probed (and if not, why).
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.events import wire

C = wire.CONSTANTS
OPS = {C["TLS_BIND"]: "bind", C["TLS_ESTABLISHED"]: "established", C["TLS_FREE"]: "free"}
VIA = {C["TLS_VIA_SET_FD"]: "set_fd", C["TLS_VIA_SYSCALL"]: "syscall",
       C["TLS_VIA_BIO_IN"]: "bio_in", C["TLS_VIA_BIO_OUT"]: "bio_out"}


@dataclass(frozen=True, slots=True)
class TlsEvent:
    """One TLS record. ``ssl`` is the SSL object (an address in process ``pid``); ``fd``
    and ``conn_id`` its socket (-1 and 0 when it was never tied to one). ``via``: how a
    ``bind`` learned the socket. ``fresh``: the object was seen from its setup, so its
    plaintext stream is followed from its first byte. ``bytes_in``/``bytes_out``: the
    plaintext it had moved when the record was made."""

    pid: int
    tid: int
    fd: int
    conn_id: int
    ts: int
    ssl: int
    op: str
    via: str | None
    fresh: bool
    established: bool
    failed: bool
    bytes_in: int
    bytes_out: int

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.pid, self.fd, self.conn_id)


@dataclass(frozen=True, slots=True)
class TlsLibrary:
    """A TLS library found mapped in traced process ``pid``.

    ``status``: ``probed`` (its plaintext is seen), ``unknown_version`` (an OpenSSL-like
    libssl of a version the probes were not written for: not probed), ``unsupported``
    (another TLS library: GnuTLS, NSS...), ``no_symbols`` (a TLS library linked into a
    binary without the symbols to find its functions, e.g. BoringSSL inside grpcio), or
    ``error`` (it could not be read or attached); ``reason`` says more."""

    pid: int
    ts: int
    path: str
    name: str  # "OpenSSL 3.0.19", "BoringSSL", "GnuTLS", ...
    status: str
    reason: str = ""
    crypto_path: str = ""  # the libcrypto whose BIO functions were probed with it


def _decode(buf: bytes) -> TlsEvent:
    f = wire.TLS.unpack(buf)
    op = OPS.get(int(f["op"]))  # type: ignore[call-overload]
    if op is None:
        raise wire.WireError(f"tls record with unknown op {f['op']}")
    flags = int(f["flags"])  # type: ignore[call-overload]
    return TlsEvent(
        pid=f["pid"], tid=f["tid"], fd=f["fd"], conn_id=f["conn_id"], ts=f["ts"],  # type: ignore[arg-type]
        ssl=f["ssl"], op=op, via=VIA.get(int(f["via"])),  # type: ignore[arg-type, call-overload]
        fresh=bool(flags & C["TLS_F_FRESH"]), established=bool(flags & C["TLS_F_ESTABLISHED"]),
        failed=bool(flags & C["TLS_F_FAILED"]),
        bytes_in=f["bytes_in"], bytes_out=f["bytes_out"],  # type: ignore[arg-type]
    )


DECODERS = {C["KIND_TLS"]: _decode}
