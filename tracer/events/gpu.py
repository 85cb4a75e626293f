"""Typed GPU events decoded from the CUDA/NCCL probes' records (bpf/cuda.c, bpf/nccl.c).

High-rate calls never arrive one by one: a thread's kernel launches, copies and memsets
are summed in the kernel into a ``KernelBurst``, flushed at a synchronisation point, at
a bounded interval, when its handle slots fill, or when the thread exits. Low-rate
calls (kernel-name resolution, device allocations, NCCL) arrive as single records.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.events import wire

C = wire.CONSTANTS
COPY_KINDS = ("h2d", "d2h", "d2d", "other")
BURST_REASONS = {C["BURST_SYNC"]: "sync", C["BURST_QUERY"]: "query",
                 C["BURST_INTERVAL"]: "interval", C["BURST_SLOTS"]: "slots",
                 C["BURST_EXIT"]: "exit", C["BURST_DRAIN"]: "drain"}
NCCL_OPS = {C[k]: k[5:].lower() for k in C if k.startswith("NCCL_")}
# ncclDataType_t -> bytes per element (nccl.h: int8, uint8, int32, uint32, int64, uint64,
# float16, float32, float64, bfloat16, fp8 e4m3, fp8 e5m2)
NCCL_DTYPE_SIZE = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 1, 11: 1}


@dataclass(frozen=True, slots=True)
class KernelBurst:
    """One thread's GPU calls between two flushes, summed in the kernel."""

    pid: int
    tid: int
    reason: str
    sync_api: int
    first_ts: int
    last_ts: int
    launches: int
    graph_launches: int
    copy_bytes: dict[str, int]
    copy_calls: dict[str, int]
    memset_bytes: int
    memset_calls: int
    sync_calls: int
    sync_wait_ns: int
    query_polls: int
    handle_counts: dict[int, int]  # launched handle -> launches in this burst


@dataclass(frozen=True, slots=True)
class KernelName:
    """A kernel handle resolved to its (mangled) name, or an alias of another handle."""

    pid: int
    tid: int
    ts: int
    source: int
    handle: int
    alias_of: int
    name: str


@dataclass(frozen=True, slots=True)
class MemEvent:
    """A device allocation or free; ``live`` is the process's device bytes after it."""

    pid: int
    tid: int
    ts: int
    op: str  # "alloc" / "free"
    ptr: int
    bytes: int
    live: int
    known: bool


@dataclass(frozen=True, slots=True)
class NcclEvent:
    """One NCCL call (enqueue time: the collective itself runs on the GPU stream)."""

    pid: int
    tid: int
    op: str
    dtype: int
    ts_enter: int
    ts_exit: int
    count: int
    comm: int
    stream: int
    comm_id: int
    peer: int
    nranks: int
    ret: int

    @property
    def bytes(self) -> int:
        """count x dtype size (0 for group markers and communicator init)."""
        return self.count * NCCL_DTYPE_SIZE.get(self.dtype, 0)


def _decode_burst(buf: bytes) -> KernelBurst:
    f = wire.KBURST.unpack(buf)
    n = min(f["nslots"], C["BURST_SLOTS_N"])
    handles: dict[int, int] = {}
    for h, k in zip(f["handles"][:n], f["handle_counts"][:n]):
        handles[h] = handles.get(h, 0) + k
    return KernelBurst(
        pid=f["pid"], tid=f["tid"], reason=BURST_REASONS.get(f["reason"], str(f["reason"])),
        sync_api=f["sync_api"], first_ts=f["first_ts"], last_ts=f["last_ts"],
        launches=f["launches"], graph_launches=f["graph_launches"],
        copy_bytes=dict(zip(COPY_KINDS, f["copy_bytes"])),
        copy_calls=dict(zip(COPY_KINDS, f["copy_calls"])),
        memset_bytes=f["memset_bytes"], memset_calls=f["memset_calls"],
        sync_calls=f["sync_calls"], sync_wait_ns=f["sync_wait_ns"],
        query_polls=f["query_polls"], handle_counts=handles,
    )


def _decode_name(buf: bytes) -> KernelName:
    f = wire.KNAME.unpack(buf)
    return KernelName(
        pid=f["pid"], tid=f["tid"], ts=f["ts"], source=f["source"], handle=f["handle"],
        alias_of=f["alias_of"],
        name=f["name"].split(b"\0", 1)[0].decode("utf-8", "replace"),
    )


def _decode_mem(buf: bytes) -> MemEvent:
    f = wire.MEM.unpack(buf)
    return MemEvent(pid=f["pid"], tid=f["tid"], ts=f["ts"],
                    op="alloc" if f["op"] == C["MEM_ALLOC"] else "free", ptr=f["ptr"],
                    bytes=f["bytes"], live=f["live"], known=bool(f["known"]))


def _decode_nccl(buf: bytes) -> NcclEvent:
    f = wire.NCCL.unpack(buf)
    return NcclEvent(pid=f["pid"], tid=f["tid"], op=NCCL_OPS.get(f["op"], str(f["op"])),
                     dtype=f["dtype"], ts_enter=f["ts_enter"], ts_exit=f["ts_exit"],
                     count=f["count"], comm=f["comm"], stream=f["stream"],
                     comm_id=f["comm_id"], peer=f["peer"], nranks=f["nranks"], ret=f["ret"])


GpuEvent = KernelBurst | KernelName | MemEvent | NcclEvent

DECODERS = {
    C["KIND_KBURST"]: _decode_burst,
    C["KIND_KNAME"]: _decode_name,
    C["KIND_MEM"]: _decode_mem,
    C["KIND_NCCL"]: _decode_nccl,
}
