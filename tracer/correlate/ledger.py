"""Conservation: per GPU process and quantity, what was observed, what was charged to
requests and what was left unattributed (with the reason). Charged plus unattributed
equals observed, exactly up to float rounding, for every quantity: a report whose
per-request costs add up to more than the GPU did is wrong however good each number
looks.

The correlator books each amount once, at the moment it decides: ``observe`` when a
step closes or a same-thread burst arrives, ``charge`` per request share, ``leave`` for
work no request was in. ``reconciliation`` is what the exit report and ``--summary``
print.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping

from tracer.correlate.work import QUANTITIES, Work
from tracer.events.gpu import SAMPLED_COPY_KINDS

# Why work was left unattributed.
NO_REQUEST = "no_request"  # a step no traced request was in (warm-up, idle, untraced)
UNJOINED_RANK = "unjoined_rank"  # a tensor-parallel rank's step not matched to rank 0's
EVICTED = "evicted"  # dropped unsettled to bound memory
# what --gpu-sample estimates for a step the launch probes did not see whole: its
# launches and span, and the SAMPLED_COPY_KINDS copies and the syncs' wait where those
# were sampled too
ESTIMATED = ("kernel_launches", "graph_launches", "gpu_time_ns")
ESTIMATED_COPIES = tuple(f"memcpy_bytes.{k}" for k in SAMPLED_COPY_KINDS) + ("sync_wait_ns",)
TOLERANCE = 1e-6  # relative: float rounding of many fractional shares


ESTIMATED_MEMSETS = ("memset_bytes",)


def estimated_quantities(copies: bool, memsets: bool = False) -> tuple[str, ...]:
    """What is estimated of a step the probes did not see whole (``copies``: with the
    sampled copies; ``memsets``: with its memsets)."""
    return (ESTIMATED + (ESTIMATED_COPIES if copies else ())
            + (ESTIMATED_MEMSETS if memsets else ()))


class Ledger:
    """Observed, charged and unattributed work per GPU process."""

    def __init__(self) -> None:
        self.observed: dict[int, Work] = defaultdict(Work)
        # the part of observed that is estimated (--gpu-sample: steps' launches and
        # spans the launch probes did not see whole)
        self.estimated: dict[int, Work] = defaultdict(Work)
        self.charged: dict[int, Work] = defaultdict(Work)
        self.unattributed: dict[int, dict[str, Work]] = defaultdict(lambda: defaultdict(Work))

    def observe(self, pid: int, work: Mapping[str, float], estimated: bool = False,
                copies_estimated: bool = False, memsets_estimated: bool = False) -> None:
        self.observed[pid].add(work)
        if estimated:
            self.estimated[pid].add({q: work.get(q, 0.0) for q in
                                     estimated_quantities(copies_estimated, memsets_estimated)})

    def revise(self, pid: int, seen: Mapping[str, float], estimate: Mapping[str, float]
               ) -> None:
        """Work observed as ``seen`` is now ``estimate`` (a step estimated after it
        closed): observed moves by the difference, all of ``estimate`` is estimated."""
        obs = self.observed[pid]
        obs.add(estimate)
        obs.add(seen, -1.0)
        self.estimated[pid].add(estimate)

    def charge(self, pid: int, work: Mapping[str, float], fraction: float = 1.0) -> None:
        self.charged[pid].add(work, fraction)

    def leave(self, pid: int, reason: str, work: Mapping[str, float]) -> None:
        self.unattributed[pid][reason].add(work)

    def residual(self, pid: int) -> Work:
        """observed - charged - unattributed, per quantity (zero when conserved)."""
        out = Work(self.observed[pid])
        out.add(self.charged[pid], -1.0)
        for w in self.unattributed[pid].values():
            out.add(w, -1.0)
        return out

    def balanced(self) -> bool:
        """Every process's every quantity conserved to ``TOLERANCE``."""
        for pid in self.observed:
            res = self.residual(pid)
            for q in QUANTITIES:
                if abs(res.get(q, 0.0)) > TOLERANCE * max(1.0, abs(self.observed[pid].get(q, 0))):
                    return False
        return True

    def reconciliation(self) -> dict[str, Any]:
        """Per process: each quantity's observed, charged, unattributed (by reason) and
        residual, and whether all balance."""
        procs = {}
        for pid in sorted(self.observed):
            res = self.residual(pid)
            rows = {}
            for q in QUANTITIES:
                obs = self.observed[pid].get(q, 0.0)
                left = {r: w.get(q, 0.0) for r, w in sorted(self.unattributed[pid].items())
                        if w.get(q, 0.0)}
                if not obs and not left and not self.charged[pid].get(q):
                    continue
                rows[q] = {"observed": obs, "charged": self.charged[pid].get(q, 0.0),
                           "unattributed": sum(left.values()), "unattributed_by": left,
                           "residual": res.get(q, 0.0)}
                if self.estimated[pid].get(q):
                    rows[q]["estimated"] = self.estimated[pid][q]
            procs[str(pid)] = rows
        return {"balanced": self.balanced(), "processes": procs}
