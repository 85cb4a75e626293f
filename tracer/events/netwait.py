"""Typed events of the kernel's hold on a served request's bytes (bpf/netwait.c).

``NetWait`` records come from the kernel: when a read's bytes reached the socket
(``arrival``), and when written bytes sat unsent (``hold``) and then left
(``departure``). ``NetTimingMode`` is written by the capture at its start and at each
switch of ``--control net-timing``: whether those probes run (``socket``) or the spans
keep syscall times (``syscall``), and why.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.events import wire

C = wire.CONSTANTS
OPS = {C["NW_ARRIVAL"]: "arrival", C["NW_HOLD"]: "hold", C["NW_DEPARTURE"]: "departure",
       C["NW_UNSEEN"]: "unseen", C["NW_LATER"]: "later"}
CAUSES = {C["NW_CAUSE_NAGLE"]: "nagle", C["NW_CAUSE_CWND"]: "cwnd",
          C["NW_CAUSE_RWND"]: "rwnd", C["NW_CAUSE_CORK"]: "cork"}


@dataclass(frozen=True, slots=True)
class NetWait:
    """One NETWAIT record. ``op``: ``arrival``, ``later``, ``hold``, ``departure`` or
    ``unseen``.

    arrival: the read that exited at ``ref_ts`` (its stream offset ``stream_off``)
    returned bytes that reached the socket at ``ts`` (0: not seen); ``estab_ts`` is the
    handshake's completion on the owner's first read of a new connection (else 0).
    later: that read (or a later one of the same burst) also returned a data segment
    that came after the burst's oldest bytes: bytes from ``stream_off`` on reached the
    socket at ``ts``.
    hold/departure: written bytes ``[held_from, stream_off)`` were still unsent when an
    ACK came at ``ts`` (hold), or left at ``ts`` (departure); ``ref_ts`` is the exit of
    the write that ended at ``stream_off``; ``cause`` says why they waited.
    unseen: an ACK came between the socket's probe at ``ref_ts`` and this one at ``ts``
    that the kernel did not run the probe for; bytes ``[sent_from, stream_off)`` left in
    between, at a time not known."""

    pid: int
    tid: int
    fd: int
    conn_id: int
    op: str
    cause: str | None
    first: bool  # the owner's first record for this socket
    anchored: bool  # seen from the handshake: departures measurable
    ts: int
    ref_ts: int
    stream_off: int
    aux: int

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.pid, self.fd, self.conn_id)

    @property
    def estab_ts(self) -> int:
        return self.aux if self.op == "arrival" else 0

    @property
    def held_from(self) -> int:
        return self.aux if self.op in ("hold", "departure") else 0

    @property
    def sent_from(self) -> int:
        return self.aux if self.op == "unseen" else 0


@dataclass(frozen=True, slots=True)
class NetTimingMode:
    """Whether this capture times requests at the socket (``socket``: bpf/netwait.c
    runs) or by the server's syscalls only (``syscall``), and why."""

    ts: int
    mode: str
    reason: str = ""


def _decode(buf: bytes) -> NetWait:
    f = wire.NETWAIT.unpack(buf)
    flags = int(f["flags"])  # type: ignore[call-overload]
    op = OPS.get(int(f["op"]))  # type: ignore[call-overload]
    if op is None:
        raise wire.WireError(f"netwait record with unknown op {f['op']}")
    return NetWait(
        pid=f["pid"], tid=f["tid"], fd=f["fd"], conn_id=f["conn_id"], op=op,  # type: ignore[arg-type]
        cause=CAUSES.get(int(f["cause"])),  # type: ignore[call-overload]
        first=bool(flags & C["NW_FLAG_FIRST"]), anchored=bool(flags & C["NW_FLAG_ANCHORED"]),
        ts=f["ts"], ref_ts=f["ref_ts"], stream_off=f["stream_off"], aux=f["aux"],  # type: ignore[arg-type]
    )


DECODERS = {C["KIND_NETWAIT"]: _decode}
