"""Typed GPU events decoded from the CUDA/NCCL/ibverbs probes' records (bpf/cuda.c,
bpf/nccl.c, bpf/ibverbs.c).

High-rate calls never arrive one by one: a thread's kernel launches, copies and memsets
are summed in the kernel into a ``KernelBurst``, flushed at a synchronisation point, at
a bounded interval, when its handle slots fill, or when the thread exits. Low-rate
calls (kernel-name resolution, a host stub per kernel, device allocations, NCCL) arrive
as single records. ibverbs posts and completions are counted in the kernel per thread, QP and opcode and
arrive as ``VerbsCounts`` deltas; memory registrations and QP state changes one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.events import wire

C = wire.CONSTANTS
COPY_KINDS = ("h2d", "d2h", "d2d", "other")
# Copies whose probes --gpu-sample can switch on and off with the launch probes. HF
# serve's engine makes ~38 device-to-device copies a step (45% of the GPU probes' traps
# left once launches are sampled, an H200 census: 3,323 a second of ~7,300) and ~7
# host-to-device ones (its inputs, each followed by a sync: ~1,000 a second a server on
# 4 H200s). Where they are switched (``GpuSampling.copies``), a step the probes did not
# see whole takes them from its reference as it takes its launches
# (tracer/correlate/sampling.py), and the other probes tell its shape: its syncs, memsets
# and the device-to-host copy that brings its tokens back (whose bytes grow with the
# batch, as the input copies' do).
SAMPLED_COPY_KINDS = ("h2d", "d2d")
# the kernel's gate of those copies (CFG_COPY_GATE_CLOSED): a bit per TT_COPY_* kind
# GpuSampling.copy_kinds: those copies and the syncs (captures that name the copies only
# kept the syncs probed; replayed, they are estimated as if they had not, and say so)
SAMPLED_COPIES = ",".join((*SAMPLED_COPY_KINDS, "sync"))
# Memsets can be switched with the launch probes too, on their own (GpuSampling.memsets):
# HF serve CB on the lent hosts makes ~9 a step, one a sync, while its H100 captures
# make one in a few steps only. They are in no step's shape, so a step the probes did
# not see whole takes its reference's where they were switched; their bit in the
# kernel's copy gate (CFG_COPY_GATE_CLOSED) is the one after the copy kinds'.
MEMSET_GATE = 1 << C["COPY_KINDS"]
# The syncs (cuStreamSynchronize, cuEventSynchronize, cuCtxSynchronize) go on and off
# with the sampled copies: HF serve CB makes nine a step, eight after its input copies
# (a third of the GPU probes' traps left under sampling, 4xH100). Their bit in the
# copy gate is the one after the memsets'. While it is closed, the device-to-host copy
# that brings a step's results back flushes its burst ("copy"), so each step still
# ends where its results come back (exactly one such copy a step on HF serve CB's H100
# captures: bench/results/step_markers-h100.json), just before the sync that would
# have timed the wait.
SYNC_GATE = 1 << (C["COPY_KINDS"] + 1)
SAMPLED_COPY_MASK = sum(1 << C[f"COPY_{k.upper()}"] for k in SAMPLED_COPY_KINDS)
SHAPE_COPY_KINDS = tuple(k for k in COPY_KINDS if k not in SAMPLED_COPY_KINDS)
BURST_REASONS = {C["BURST_SYNC"]: "sync", C["BURST_QUERY"]: "query",
                 C["BURST_INTERVAL"]: "interval", C["BURST_SLOTS"]: "slots",
                 C["BURST_EXIT"]: "exit", C["BURST_DRAIN"]: "drain", C["BURST_COPY"]: "copy"}
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


# KernelName.source: the driver's name probes see a name resolved after attach; the
# host stub route names handles resolved before it (tracer/probes/symbols.py)
NAME_SOURCES = {C["NAME_MODULE_GET_FUNCTION"]: "module_get_function",
                C["NAME_LIBRARY_GET_KERNEL"]: "library_get_kernel",
                C["NAME_KERNEL_GET_FUNCTION"]: "kernel_get_function",
                C["NAME_HOST_STUB"]: "host_stub",
                C["NAME_REGISTERED_STUB"]: "registered_stub",
                C["NAME_STUB_SLOT"]: "stub_slot",
                C["NAME_DRIVER_OBJECT"]: "driver_object",
                C["NAME_DRIVER_STRING"]: "driver_string"}
LIVE_NAME_SOURCES = frozenset({C["NAME_MODULE_GET_FUNCTION"], C["NAME_LIBRARY_GET_KERNEL"],
                               C["NAME_KERNEL_GET_FUNCTION"]})


@dataclass(frozen=True, slots=True)
class KernelStub:
    """The first launch of ``handle`` that came through the CUDA runtime after its
    probes attached: ``stub`` is the host stub address cudaLaunchKernel* was given, to
    be symbolised in process ``pid`` (a KernelName with source NAME_HOST_STUB)."""

    pid: int
    tid: int
    ts: int
    handle: int
    stub: int


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


def _burst_layout() -> tuple[int, ...]:
    """Positions in KBURST's flat unpacked tuple of the fields _decode_burst reads."""
    pos, i = {}, 0
    for f in wire.KBURST.fields:
        pos[f.name] = i
        i += f.array_len if f.array_len and not f.is_bytes else 1
    return tuple(pos[n] for n in (
        "pid", "tid", "reason", "sync_api", "first_ts", "last_ts", "launches",
        "graph_launches", "copy_bytes", "copy_calls", "memset_bytes", "memset_calls",
        "sync_calls", "sync_wait_ns", "query_polls", "nslots", "handles", "handle_counts"))


(_PID, _TID, _REASON, _SYNC_API, _FIRST, _LAST, _LAUNCHES, _GRAPH, _CB, _CC, _MSB, _MSC,
 _SYNCS, _WAIT, _POLLS, _NSLOTS, _HANDLES, _COUNTS) = _burst_layout()
_NCOPY = C["COPY_KINDS"]
_SLOTS = C["BURST_SLOTS_N"]
_UNPACK_BURST = wire.KBURST.header.unpack_from


def _decode_burst(buf: bytes) -> KernelBurst:
    # Runs once per burst, the agent's hottest path: one unpack into a flat tuple and
    # fixed positions, no per-field dict (profiled: 2.5x faster than Record.unpack).
    v = _UNPACK_BURST(buf, 0)
    n = min(v[_NSLOTS], _SLOTS)
    handles = v[_HANDLES:_HANDLES + n]
    counts = v[_COUNTS:_COUNTS + n]
    hc = dict(zip(handles, counts))
    if len(hc) != n:  # the kernel keeps one slot per handle; sum anyway if not
        hc = {}
        for h, k in zip(handles, counts):
            hc[h] = hc.get(h, 0) + k
    return KernelBurst(
        v[_PID], v[_TID], BURST_REASONS.get(v[_REASON]) or str(v[_REASON]), v[_SYNC_API],
        v[_FIRST], v[_LAST], v[_LAUNCHES], v[_GRAPH],
        dict(zip(COPY_KINDS, v[_CB:_CB + _NCOPY])), dict(zip(COPY_KINDS, v[_CC:_CC + _NCOPY])),
        v[_MSB], v[_MSC], v[_SYNCS], v[_WAIT], v[_POLLS], hc)


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


def _decode_stub(buf: bytes) -> KernelStub:
    f = wire.KSTUB.unpack(buf)
    return KernelStub(pid=f["pid"], tid=f["tid"], ts=f["ts"], handle=f["handle"],
                      stub=f["stub"])


@dataclass(frozen=True, slots=True)
class KernelCounts:
    """Launches of one kernel by one thread that found its burst's slots full, since
    the previous read (they are already in the bursts' ``launches``)."""

    pid: int
    tid: int
    ts: int
    handle: int
    count: int


def _decode_kcount(buf: bytes) -> KernelCounts:
    f = wire.KCOUNT.unpack(buf)
    return KernelCounts(pid=f["pid"], tid=f["tid"], ts=f["ts"], handle=f["handle"],
                        count=f["count"])


@dataclass(frozen=True, slots=True)
class GpuSampling:
    """--gpu-sample switched the launch probes on (stamped after the attach) or off
    (stamped before the detach) at ``ts``. Launch counts are then estimates
    (tracer/correlate/sampling.py). ``fraction`` is the configured share;
    ``attach_s`` is how long this switch's attach took, ``detach_s`` how long the
    previous detach took (both 0 where unknown, as in older captures). ``reason``: why
    sampling began or ended where the agent chose it (``--gpu-sample auto``), else
    empty. ``copies``: the probes of the copies and syncs ``copy_kinds`` names
    (comma-separated: ``SAMPLED_COPY_KINDS`` and "sync") are switched with the launch
    probes (their counts are estimates too); False in older captures. ``memsets``: the
    same for the memset probes (``MEMSET_GATE``). A capture whose kinds differ from
    this version's is replayed as if these were switched, and says so
    (``launch_sampling.problem`` in the GPU summary)."""

    ts: int
    enabled: bool
    fraction: float
    attach_s: float = 0.0
    detach_s: float = 0.0
    reason: str = ""
    copies: bool = False
    copy_kinds: str = SAMPLED_COPIES
    memsets: bool = False  # the memset probes switched with the launch probes too


VERBS_OPS = {C["VERBS_SEND"]: "send", C["VERBS_RECV"]: "recv",
             C["VERBS_POST_SEND_CALL"]: "post_send_call",
             C["VERBS_POST_RECV_CALL"]: "post_recv_call", C["VERBS_CQE"]: "cqe",
             C["VERBS_POLL"]: "poll"}
# enum ibv_wr_opcode (verbs.h)
WR_OPCODES = {0: "rdma_write", 1: "rdma_write_with_imm", 2: "send", 3: "send_with_imm",
              4: "rdma_read", 5: "atomic_cmp_and_swp", 6: "atomic_fetch_and_add",
              7: "local_inv", 8: "bind_mw", 9: "send_with_inv", 10: "tso", 11: "driver1",
              15: "atomic_write"}
# enum ibv_wc_opcode (verbs.h), plus the probe's own markers
WC_OPCODES = {0: "send", 1: "rdma_write", 2: "rdma_read", 3: "comp_swap", 4: "fetch_add",
              5: "bind_mw", 6: "local_inv", 7: "tso", 9: "atomic_write", 128: "recv",
              129: "recv_rdma_with_imm", 130: "tm_add", 131: "tm_del", 132: "tm_sync",
              133: "tm_recv", 134: "tm_no_tag", 135: "driver1", 136: "driver2",
              137: "driver3", C["VERBS_OPCODE_ERROR"]: "error",
              C["VERBS_OPCODE_UNREAD"]: "unread"}
# enum ibv_qp_state (verbs.h)
QP_STATES = {0: "reset", 1: "init", 2: "rtr", 3: "rts", 4: "sqd", 5: "sqe", 6: "err",
             7: "unknown"}


@dataclass(frozen=True, slots=True)
class VerbsCounts:
    """What one thread did on one QP since the previous read of the kernel's counters.

    ``op``: "send"/"recv" (work requests posted, ``opcode`` names the verb; ``bytes``
    is the sum of their sge lengths, ``extra`` their sges), "post_send_call" /
    "post_recv_call" (calls; ``extra``: chains longer than the probe reads), "cqe"
    (completions by opcode, "error" for failed ones; ``bytes``: wc.byte_len of
    successful receives) or "poll" (ibv_poll_cq calls; ``errors``: negative returns,
    ``extra``: empty polls)."""

    pid: int
    tid: int
    qp_num: int
    op: str
    opcode: str
    ts: int
    count: int
    bytes: int
    errors: int
    extra: int


@dataclass(frozen=True, slots=True)
class VerbsContext:
    """A device context first seen, with its provider's data-path functions."""

    pid: int
    tid: int
    ts: int
    via: int
    ctx: int
    post_send: int
    post_recv: int
    poll_cq: int


@dataclass(frozen=True, slots=True)
class VerbsMr:
    """A memory registration ("reg") or deregistration ("dereg")."""

    pid: int
    tid: int
    ts: int
    op: str
    mr: int
    addr: int
    length: int
    lkey: int
    rkey: int
    access: int
    ret: int


@dataclass(frozen=True, slots=True)
class VerbsQp:
    """An ibv_modify_qp call: the state asked for ("" if not in the mask), the remote
    QP (-1 if not in the mask) and the result (0 or an errno)."""

    pid: int
    tid: int
    ts: int
    qp_num: int
    state: str
    dest_qp_num: int
    attr_mask: int
    ret: int


def _decode_verbs(buf: bytes) -> VerbsCounts:
    f = wire.VERBS.unpack(buf)
    op = VERBS_OPS.get(f["op"], str(f["op"]))
    names = WR_OPCODES if op == "send" else WC_OPCODES if op == "cqe" else {0: ""}
    return VerbsCounts(pid=f["pid"], tid=f["tid"], qp_num=f["qp_num"], op=op,
                       opcode=names.get(f["opcode"], str(f["opcode"])), ts=f["ts"],
                       count=f["count"], bytes=f["bytes"], errors=f["errors"],
                       extra=f["extra"])


def _decode_verbs_ctx(buf: bytes) -> VerbsContext:
    f = wire.VERBS_CTX.unpack(buf)
    return VerbsContext(pid=f["pid"], tid=f["tid"], ts=f["ts"], via=f["via"], ctx=f["ctx"],
                        post_send=f["post_send"], post_recv=f["post_recv"],
                        poll_cq=f["poll_cq"])


def _decode_verbs_mr(buf: bytes) -> VerbsMr:
    f = wire.VERBS_MR.unpack(buf)
    return VerbsMr(pid=f["pid"], tid=f["tid"], ts=f["ts"],
                   op="reg" if f["op"] == C["VERBS_REG_MR"] else "dereg", mr=f["mr"],
                   addr=f["addr"], length=f["length"], lkey=f["lkey"], rkey=f["rkey"],
                   access=f["access"], ret=f["ret"])


def _decode_verbs_qp(buf: bytes) -> VerbsQp:
    f = wire.VERBS_QP.unpack(buf)
    state = "" if f["state"] < 0 else QP_STATES.get(f["state"], str(f["state"]))
    return VerbsQp(pid=f["pid"], tid=f["tid"], ts=f["ts"], qp_num=f["qp_num"], state=state,
                   dest_qp_num=f["dest_qp_num"], attr_mask=f["attr_mask"], ret=f["ret"])


GpuEvent = (KernelBurst | KernelName | KernelStub | MemEvent | NcclEvent | KernelCounts
            | VerbsCounts | VerbsContext | VerbsMr | VerbsQp | GpuSampling)

DECODERS = {
    C["KIND_KBURST"]: _decode_burst,
    C["KIND_KNAME"]: _decode_name,
    C["KIND_MEM"]: _decode_mem,
    C["KIND_NCCL"]: _decode_nccl,
    C["KIND_KCOUNT"]: _decode_kcount,
    C["KIND_KSTUB"]: _decode_stub,
    C["KIND_VERBS"]: _decode_verbs,
    C["KIND_VERBS_CTX"]: _decode_verbs_ctx,
    C["KIND_VERBS_MR"]: _decode_verbs_mr,
    C["KIND_VERBS_QP"]: _decode_verbs_qp,
}
