"""Typed events of the launch-site stack sampler (bpf/stacks.c).

``StackCounts`` (a KSTACKS record) is one thread's sampled GPU calls since its last
burst, counted per stack in the kernel; it arrives right before the ``KernelBurst`` it
was taken in, so the correlator hands a burst's stacks to whoever gets the burst.
``StackDef`` (a STACKDEF record, live only: it carries raw stack memory and never goes
into a capture) is the first sample of a stack id; the agent unwinds and symbolises
it into a ``StackFrames`` user event, which is what captures keep and replays read.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.events import wire

C = wire.CONSTANTS
COPY_NAMES = {C["COPY_H2D"]: "HtoD", C["COPY_D2H"]: "DtoH", C["COPY_D2D"]: "DtoD",
              C["COPY_OTHER"]: "unified"}
NCCL_NAMES = {C[k]: k[5:].lower() for k in C if k.startswith("NCCL_")}


def what_label(what: int) -> str:
    """A readable name of a sampled call's kind (TT_STK_*): ``kernel``, ``graph``,
    ``memcpy HtoD``, ``nccl allreduce``."""
    if what == C["STK_KERNEL"]:
        return "kernel"
    if what == C["STK_GRAPH"]:
        return "graph"
    if C["STK_COPY"] <= what < C["STK_COPY"] + C["COPY_KINDS"]:
        return "memcpy " + COPY_NAMES[what - C["STK_COPY"]]
    if what >= C["STK_NCCL"]:
        return "nccl " + NCCL_NAMES.get(what - C["STK_NCCL"], str(what - C["STK_NCCL"]))
    return f"call {what}"


@dataclass(frozen=True, slots=True)
class StackCounts:
    """Sampled GPU calls of one thread per stack: ``entries`` are (stack id, kind
    TT_STK_*, handle, count). ``burst_ts`` is the first_ts of the burst they belong to
    (0: taken with no burst open, e.g. an NCCL call; they go with the thread's next)."""

    pid: int
    tid: int
    burst_ts: int
    samples: int  # the thread's samples so far (all bursts)
    entries: tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True, slots=True)
class StackDef:
    """The first sample of a stack: Python frames as (code object, instruction) pairs,
    innermost first (code 0: a C-stack shim frame, skipped), and the registers and
    first ``len(slice)`` bytes of the user stack at the probe."""

    pid: int
    tid: int
    stack_id: int
    what: int
    handle: int
    flags: int
    ts: int
    ip: int
    sp: int
    bp: int
    python: tuple[tuple[int, int], ...]
    slice: bytes


@dataclass(frozen=True, slots=True)
class StackFrames:
    """A stack id resolved in user space (a capture's user event).

    ``python``: frames root first, each ``"qualname\\tfile\\tline"``; ``native``: the
    native frames between the interpreter and the GPU call, root first, each
    ``"symbol\\tfile"`` (symbol empty when unknown, then file carries ``+0xoffset``).
    ``flags``: STACKDEF flags; ``native_stop``: why native unwinding stopped where it
    did (``interpreter``, ``no unwind info``, ...)."""

    pid: int
    stack_id: int
    what: int
    handle: int
    python: tuple[str, ...]
    native: tuple[str, ...]
    flags: int = 0
    native_stop: str = ""


@dataclass(frozen=True, slots=True)
class StackSampling:
    """Stack sampling was set up (a capture's user event, once at its start): from here
    on every GPU call of a traced process belongs to some stack in the flame graphs,
    sampled or, where no sample was taken yet, ``[no stack sampled]``."""

    ts: int
    every: int


def _decode_counts(buf: bytes) -> StackCounts:
    f = wire.KSTACKS.unpack(buf)
    n = min(f["n"], C["STACK_SLOTS_N"])
    ids, whats, handles, counts = f["ids"], f["whats"], f["handles"], f["counts"]
    entries = tuple((ids[i], whats[i], handles[i], counts[i]) for i in range(n))
    return StackCounts(pid=f["pid"], tid=f["tid"], burst_ts=f["burst_ts"],
                       samples=f["samples"], entries=entries)


def _decode_def(buf: bytes) -> StackDef:
    f = wire.STACKDEF.unpack(buf)
    depth = min(f["py_depth"], C["PY_FRAMES_N"])
    start = wire.STACKDEF.header_size
    n = min(f["slice_len"], max(0, len(buf) - start))
    return StackDef(pid=f["pid"], tid=f["tid"], stack_id=f["stack_id"], what=f["what"],
                    handle=f["handle"], flags=f["flags"], ts=f["ts"], ip=f["ip"], sp=f["sp"],
                    bp=f["bp"], python=tuple(zip(f["py_code"][:depth], f["py_instr"][:depth])),
                    slice=bytes(buf[start:start + n]))


DECODERS = {C["KIND_KSTACKS"]: _decode_counts, C["KIND_STACKDEF"]: _decode_def}
