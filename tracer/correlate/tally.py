"""Decoding members' shares of an engine thread's steps, summed once per step.

Most members of most continuous-batching steps are decoding, and every decoding
member of a step is charged the same fraction of it (one sequence's marginal cost
plus an equal part of the fixed cost: ``costmodel.member_costs``). So rather than
noting each member's part of each step (a request decodes for hundreds of steps,
each with dozens of members), a ``Tally`` per step log keeps the running sums of
what one decoding member was charged, step after step (``Sums``, a new one per
step), and a member's ``Run`` of consecutive steps is charged the difference of the
sums at its two ends. The work per token is then per step, not per member: the
member only moves its run's end to the step's new sums.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tracer.correlate.steps import Step
from tracer.correlate.work import Work


@dataclass(frozen=True)
class Sums:
    """What one member decoding in every step of a log so far would have been charged."""

    work: dict[str, float] = field(default_factory=dict)
    launches: float = 0.0  # kernel launches (as counted; also in ``work``)
    kernels: dict[tuple[int, int], float] = field(default_factory=dict)  # (pid, handle)
    steps: int = 0  # rank-0 steps (another rank's step is the same step)
    estimated: int = 0  # of them, steps whose launches are estimates (--gpu-sample)
    bursts: int = 0


class Tally:
    """The running ``Sums`` of one step log's decoding members."""

    def __init__(self) -> None:
        self.sums = Sums()
        self.label: tuple[object, ...] | None = None  # what the last step said of itself

    def add(self, step: Step, fk: float, ft: float, rank: int) -> Sums:
        """Step ``step`` split with ``fk`` of its launches and ``ft`` of the rest (time,
        bytes, collectives) to each decoding member: the new sums."""
        _, _, kl, nl, (pid, mix) = step._settled or step.settled_work()
        s = self.sums
        work = dict(s.work)
        step.add_share(work, fk, ft)
        launches = kl * fk
        kernels = s.kernels
        if nl and launches:
            kernels = dict(kernels)
            f = launches / nl
            for h, n in mix:
                kernels[(pid, h)] = kernels.get((pid, h), 0.0) + n * f
        first_rank = rank == 0
        self.sums = Sums(work, s.launches + launches, kernels, s.steps + first_rank,
                         s.estimated + (first_rank and step.estimated), s.bursts + step.bursts)
        return self.sums


class Run:
    """A member's consecutive decoding steps of one log: charged ``end - base``."""

    __slots__ = ("base", "end")

    def __init__(self, base: Sums, end: Sums) -> None:
        self.base = base
        self.end = end

    def fold_into(self, work: Work, kernels: dict[tuple[int, int], float]
                  ) -> tuple[float, int, int, int]:
        """Add what the run was charged so far to ``work`` and ``kernels``; returns its
        (launches, steps, estimated steps, bursts). The run then starts afresh from its
        end (a run folded early, then extended, is charged each step once)."""
        b, e = self.base, self.end
        if b is e:
            return 0.0, 0, 0, 0
        bw = b.work
        for q, v in e.work.items():
            d = v - bw.get(q, 0.0)
            if d:
                work[q] = work.get(q, 0.0) + d
        if e.kernels is not b.kernels:
            bk = b.kernels
            for k, v in e.kernels.items():
                d = v - bk.get(k, 0.0)
                if d:
                    kernels[k] = kernels.get(k, 0.0) + d
        self.base = e
        return (e.launches - b.launches, e.steps - b.steps, e.estimated - b.estimated,
                e.bursts - b.bursts)
