"""The GPU ledger: per process and per thread totals of what the CUDA and NCCL probes
saw, with kernel handles resolved to names. It consumes the GPU events in order (live
or replayed) and never sees a single launch: only bursts summed in the kernel.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tracer.events.gpu import COPY_KINDS, KernelBurst, KernelName, MemEvent, NcclEvent


@dataclass
class ThreadTotals:
    """What one thread (or, summed, one process) did on the GPU."""

    kernel_launches: int = 0
    graph_launches: int = 0
    memcpy_bytes: Counter[str] = field(default_factory=Counter)
    memcpy_calls: Counter[str] = field(default_factory=Counter)
    memset_bytes: int = 0
    memset_calls: int = 0
    sync_calls: int = 0
    sync_wait_ns: int = 0
    query_polls: int = 0
    bursts: int = 0
    nccl_ops: Counter[str] = field(default_factory=Counter)
    nccl_bytes: Counter[str] = field(default_factory=Counter)
    kernels: Counter[int] = field(default_factory=Counter)  # handle -> launches

    def add_burst(self, b: KernelBurst) -> None:
        self.bursts += 1
        self.kernel_launches += b.launches
        self.graph_launches += b.graph_launches
        self.memcpy_bytes.update(b.copy_bytes)
        self.memcpy_calls.update(b.copy_calls)
        self.memset_bytes += b.memset_bytes
        self.memset_calls += b.memset_calls
        self.sync_calls += b.sync_calls
        self.sync_wait_ns += b.sync_wait_ns
        self.query_polls += b.query_polls
        self.kernels.update(b.handle_counts)

    def add_nccl(self, ev: NcclEvent) -> None:
        self.nccl_ops[ev.op] += 1
        self.nccl_bytes[ev.op] += ev.bytes


@dataclass
class ProcessGpu:
    pid: int
    threads: dict[int, ThreadTotals] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)  # handle -> kernel name
    live_bytes: int = 0
    peak_bytes: int = 0
    allocs: int = 0
    frees: int = 0
    frees_of_unknown: int = 0  # allocated before the tracer attached: size unknown
    communicators: list[dict[str, int]] = field(default_factory=list)

    def thread(self, tid: int) -> ThreadTotals:
        t = self.threads.get(tid)
        if t is None:
            t = self.threads[tid] = ThreadTotals()
        return t

    def name_of(self, handle: int) -> str:
        return self.names.get(handle) or f"unknown@{handle:#x}"


class GpuLedger:
    """Per-process GPU totals from a stream of GPU events."""

    def __init__(self) -> None:
        self.processes: dict[int, ProcessGpu] = {}

    def proc(self, pid: int) -> ProcessGpu:
        p = self.processes.get(pid)
        if p is None:
            p = self.processes[pid] = ProcessGpu(pid)
        return p

    def handle(self, ev: Any) -> None:
        """Account one GPU event (KernelBurst, KernelName, MemEvent or NcclEvent)."""
        if isinstance(ev, KernelBurst):
            self.proc(ev.pid).thread(ev.tid).add_burst(ev)
        elif isinstance(ev, KernelName):
            p = self.proc(ev.pid)
            name = ev.name if ev.name else p.names.get(ev.alias_of, "")
            if name:
                p.names[ev.handle] = name
        elif isinstance(ev, MemEvent):
            p = self.proc(ev.pid)
            if ev.op == "alloc":
                p.allocs += 1
            else:
                p.frees += 1
                p.frees_of_unknown += not ev.known
            p.live_bytes = ev.live
            p.peak_bytes = max(p.peak_bytes, ev.live)
        elif isinstance(ev, NcclEvent):
            p = self.proc(ev.pid)
            if ev.op == "comm_init":
                p.communicators.append({"comm": ev.comm, "rank": ev.peer,
                                        "nranks": ev.nranks, "comm_id": ev.comm_id,
                                        "ret": ev.ret})
            else:
                p.thread(ev.tid).add_nccl(ev)

    def summary(self, top: int = 20) -> dict[str, Any]:
        """A JSON-ready summary: per process, its threads, top kernels by launches."""
        out = []
        for pid, p in sorted(self.processes.items()):
            total = ThreadTotals()
            for t in p.threads.values():
                _merge(total, t)
            out.append({
                "pid": pid,
                **_totals(total, p, top),
                "device_memory": {"live_bytes": p.live_bytes, "peak_bytes": p.peak_bytes,
                                  "allocs": p.allocs, "frees": p.frees,
                                  "frees_of_unknown_size": p.frees_of_unknown},
                "nccl_communicators": p.communicators,
                "threads": {str(tid): _totals(t, p, top) for tid, t in sorted(p.threads.items())},
            })
        return {"processes": out}


def _merge(into: ThreadTotals, t: ThreadTotals) -> None:
    for name in ("kernel_launches", "graph_launches", "memset_bytes", "memset_calls",
                 "sync_calls", "sync_wait_ns", "query_polls", "bursts"):
        setattr(into, name, getattr(into, name) + getattr(t, name))
    for name in ("memcpy_bytes", "memcpy_calls", "nccl_ops", "nccl_bytes", "kernels"):
        getattr(into, name).update(getattr(t, name))


def _totals(t: ThreadTotals, p: ProcessGpu, top: int) -> dict[str, Any]:
    named: Counter[str] = Counter()
    for h, n in t.kernels.items():
        named[p.name_of(h)] += n
    return {
        "kernel_launches": t.kernel_launches,
        "graph_launches": t.graph_launches,
        "memcpy_bytes": {k: t.memcpy_bytes.get(k, 0) for k in COPY_KINDS},
        "memcpy_calls": {k: t.memcpy_calls.get(k, 0) for k in COPY_KINDS},
        "memset_bytes": t.memset_bytes,
        "memset_calls": t.memset_calls,
        "sync_calls": t.sync_calls,
        "sync_wait_ms": round(t.sync_wait_ns / 1e6, 3),
        "query_polls": t.query_polls,
        "bursts": t.bursts,
        "nccl_ops": dict(t.nccl_ops),
        "nccl_bytes": dict(t.nccl_bytes),
        "top_kernels": [{"name": n, "launches": c} for n, c in named.most_common(top)],
    }
