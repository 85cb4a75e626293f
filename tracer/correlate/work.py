"""GPU work as a vector of quantities: what a burst or a step did, what a request was
charged, what was observed and left unattributed. One definition, so every quantity is
conserved the same way.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from tracer.events.gpu import COPY_KINDS, KernelBurst

# Every quantity the correlator charges to requests and reconciles per process.
QUANTITIES = ("kernel_launches", "graph_launches",
              *(f"memcpy_bytes.{k}" for k in COPY_KINDS),
              "memset_bytes", "nccl_ops", "nccl_bytes", "sync_wait_ns", "gpu_time_ns")
# Shared by the launch-count model; the rest by the GPU-time model (costmodel.py).
KERNEL_QUANTITIES = frozenset({"kernel_launches", "graph_launches"})


class Work(dict[str, float]):
    """Quantity name -> amount; missing quantities are zero."""

    @classmethod
    def of_burst(cls, b: KernelBurst, time_ns: int | None = None) -> "Work":
        """A burst's work; its GPU time is its span unless given."""
        w = cls(kernel_launches=b.launches, graph_launches=b.graph_launches,
                memset_bytes=b.memset_bytes, sync_wait_ns=b.sync_wait_ns,
                gpu_time_ns=max(0, b.last_ts - b.first_ts) if time_ns is None else time_ns)
        for k in COPY_KINDS:
            n = b.copy_bytes.get(k, 0)
            if n:
                w[f"memcpy_bytes.{k}"] = n
        return w

    def add(self, other: Mapping[str, float], times: float = 1.0) -> None:
        """self += other * times."""
        for k, v in other.items():
            if v:
                self[k] = self.get(k, 0) + v * times

    def scaled(self, by: Mapping[str, float] | float) -> "Work":
        """A copy with each quantity multiplied (by a number, or per quantity)."""
        if isinstance(by, (int, float)):
            return Work({k: v * by for k, v in self.items()})
        return Work({k: v * by.get(k, 0.0) for k, v in self.items()})


def total(works: Iterable[Mapping[str, float]]) -> Work:
    out = Work()
    for w in works:
        out.add(w)
    return out
