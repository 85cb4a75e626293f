"""Engine steps: a GPU thread's bursts grouped into the units a batching engine works in.

A continuous-batching engine runs steps: it prepares a batch, launches one batched
forward pass, copies the sampled tokens to the host and waits for them, hands each
request in the batch its next token, and starts the next step. Seen from the probes, a
step is a run of a thread's ``KernelBurst``s ended by the synchronisation that brought
results back: a flush at a synchronising call whose burst copied device-to-host. A
host cannot learn a sampled token any other way, while the synchronisations inside a
step (input copies, bookkeeping) copy nothing back; HF ``transformers serve`` makes nine
synchronisations per step, one of them with the tokens' copy (measured on an H100 against
the server's own step records: 1,054 of 1,054 steps found, launches exact). A thread
that has never synchronised on a device-to-host copy ends a step at every
synchronisation. Where ``--gpu-sample`` has switched the syncs off with the launch
probes, the device-to-host copy itself flushes its burst ("copy") and ends the step,
just before the sync that would have. Bursts flushed by the interval timer or full
handle slots only continue a step. A step's GPU-time estimate is its span, from its
first launch to the end of its last wait (what CUDA events around the step measure: 1%
share error against them on HF serve), or, for a step that launched no kernel, its
bursts' own spans.

``StepLog`` keeps one thread's steps in order, numbered from 0, with their end times
indexed so that "the last step that had ended by time t" is a bisection
(``tracer.correlate.membership`` aligns requests' tokens with it).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from tracer.correlate.work import KERNEL_QUANTITIES, Work
from tracer.events.gpu import (COPY_KINDS, SAMPLED_COPY_KINDS, SHAPE_COPY_KINDS, KernelBurst,
                               NcclEvent)

MAX_STEPS = 200_000  # per thread: older steps are dropped first
OPEN_STEP_MAX_NS = 1_000_000_000  # a step with no result copy for this long is closed anyway
# steps' kernel mixes, each kept once (Step.kernel_mix); bounded: forgetting one only
# makes the next equal mix a new object
MIXES: dict[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]] = {}
MAX_MIXES = 4096
# where each copy kind sits in Step.copy_calls
SHAPE_COPY_INDEX = tuple(COPY_KINDS.index(k) for k in SHAPE_COPY_KINDS)
SAMPLED_COPY_INDEX = tuple(COPY_KINDS.index(k) for k in SAMPLED_COPY_KINDS)
# burst flushes that end a step where its real end went unseen (Step.end_unseen)
UNSEEN_ENDS = frozenset({"copy", "drain"})


def ends_step(b: KernelBurst, result_copies: bool) -> tuple[bool, bool]:
    """Whether burst ``b`` ends its thread's step, and whether it brought results back
    (a device-to-host copy at its flush), on a thread that has ``result_copies`` before.

    A sync timed to its return sets ``sync_api``; one only counted at its entry (an
    uprobe session skips the returns of syncs inside a step: bpf/cuda.c) ends nothing.
    While the syncs are off with the launch probes the result copy itself flushes the
    burst ("copy")."""
    synced = b.sync_api != 0 or b.reason in ("sync", "copy")
    results = synced and b.copy_calls.get("d2h", 0) > 0
    ends = results or (synced and not result_copies) or b.reason in ("exit", "drain")
    return ends, results


@dataclass
class Step:
    """One engine step of one thread: the sum of its bursts (and its NCCL calls)."""

    pid: int
    tid: int
    index: int = -1
    first_ts: int = 0
    end_ts: int = 0
    bursts: int = 0
    work: Work = field(default_factory=Work)
    kernels: Counter[int] = field(default_factory=Counter)  # handle -> launches
    settled: bool = False  # shared out among its members (or left unattributed): final
    signature: tuple[str, int, int] | None = None  # (op, count, dtype) of its 1st collective
    coll_seq: int = -1  # that collective's place among its thread's collectives

    bursts_ns: int = 0  # the bursts' own spans, summed
    # where its first burst ended: a sync, or its result copy where the syncs were off
    first_end_ts: int = 0
    # the calls seen whether or not the launch probes are on (--gpu-sample), for
    # shape(); and whether its launches and span are estimates (sampling.StepEstimates)
    memset_calls: int = 0
    sync_calls: int = 0
    query_polls: int = 0
    estimated: bool = False
    copies_estimated: bool = False  # its SAMPLED_COPY_KINDS copies too (sampled with them)
    memsets_estimated: bool = False  # and its memsets
    # its end went unseen: its last burst was flushed by its result copy with the syncs
    # off (the sync after the copy not seen) or drained at a pause (the step went on
    # unprobed). Such a step is never its shape's reference (sampling.StepEstimates)
    end_unseen: bool = False
    # not counted whole and not estimated yet (its thread had no reference): the
    # previous step's end, to estimate it once one is learnt
    unestimated_after: int | None = None
    # for launch-site stacks (tracer/correlate/stacks.py): calls per kind, and the
    # stack samples its bursts brought ((stack id, unit) -> samples)
    copy_calls: list[int] = field(default_factory=lambda: [0] * len(COPY_KINDS))
    nccl_calls: Counter[str] = field(default_factory=Counter)
    stack_samples: Counter[tuple[int, tuple[int, int]]] | None = None
    flame: object | None = None  # its stacks.Flame, computed once when it is split
    _mix: tuple[tuple[int, int], ...] | None = None
    _settled: tuple[Any, ...] | None = None  # settled_work()

    def kernel_mix(self) -> tuple[tuple[int, int], ...]:
        """Its kernels and their launches as a tuple, in launch order; equal mixes of
        other steps are the same object (``MIXES``), so a request's share of many steps
        is summed per mix, not per kernel."""
        if self._mix is None:
            mix = tuple(self.kernels.items())
            self._mix = MIXES.setdefault(mix, mix)
            if len(MIXES) > MAX_MIXES:
                MIXES.clear()
        return self._mix

    def settled_work(self) -> tuple[tuple[tuple[str, float], ...], tuple[tuple[str, float], ...],
                                    float, int, tuple[int, tuple[tuple[int, int], ...]]]:
        """Its work once settled (final), for folding a member's share of it: the
        non-zero kernel quantities (times the member's launch fraction), the non-zero
        rest (times its time fraction), its kernel launches as counted and as a whole
        number, and (pid, kernel mix)."""
        if self._settled is None:
            items = [(q, v) for q, v in self.work.items() if v]
            self._settled = (tuple((q, v) for q, v in items if q in KERNEL_QUANTITIES),
                             tuple((q, v) for q, v in items if q not in KERNEL_QUANTITIES),
                             self.work.get("kernel_launches", 0), self.launches,
                             (self.pid, self.kernel_mix()))
        return self._settled

    def add_share(self, work: dict[str, float], fk: float, ft: float) -> None:
        """Add to ``work`` a member's part of this settled step: ``fk`` of its launches
        (kernel quantities), ``ft`` of the rest (time, bytes, collectives)."""
        kernel_work, other_work = (self._settled or self.settled_work())[:2]
        if fk:
            for q, v in kernel_work:
                work[q] = work.get(q, 0.0) + v * fk
        if ft:
            for q, v in other_work:
                work[q] = work.get(q, 0.0) + v * ft

    @property
    def span_ns(self) -> int:
        """The GPU-time estimate: first launch to the end of the step's last wait (to its
        result copy where the syncs were off with the launches); for a step that
        launched no kernel (a thread that only copies, such as an API
        thread moving inputs to the device), only its bursts' own spans."""
        if not self.work.get("kernel_launches") and not self.work.get("graph_launches"):
            return self.bursts_ns
        return max(0, self.end_ts - self.first_ts)

    @property
    def launches(self) -> int:
        return int(self.work.get("kernel_launches", 0))

    def shape(self, copies_sampled: bool = False) -> tuple[int, ...]:
        """What the probes that stay on under ``--gpu-sample`` saw of it: copy calls by
        kind and sync calls (without SAMPLED_COPY_KINDS and the syncs where
        ``copies_sampled``: those are then switched with the launches), whether it
        polled. Steps of one shape launch the same kernels to within 1% on the H100
        captures (the whole mix varies 5-120%). Not its memsets, which can be switched
        with the launches on their own: left out, the H100 captures' estimates moved
        by under 1%."""
        if copies_sampled:
            return (*(self.copy_calls[i] for i in SHAPE_COPY_INDEX), self.query_polls > 0)
        return (*self.copy_calls, self.sync_calls, self.query_polls > 0)

    def sampled_copies(self) -> tuple[tuple[int, int], ...]:
        """(calls, bytes) of each of ``SAMPLED_COPY_KINDS``: estimated with the launches
        where the probes did not see the step whole."""
        return tuple((self.copy_calls[i], int(self.work.get(f"memcpy_bytes.{k}", 0)))
                     for i, k in zip(SAMPLED_COPY_INDEX, SAMPLED_COPY_KINDS))

    def set_sampled_copies(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Its ``SAMPLED_COPY_KINDS`` copies as estimated (``sampled_copies``'s form)."""
        for i, k, (calls, nbytes) in zip(SAMPLED_COPY_INDEX, SAMPLED_COPY_KINDS, copies):
            self.copy_calls[i] = calls
            self._set_work(f"memcpy_bytes.{k}", nbytes)

    def syncs(self) -> tuple[int, int]:
        """(calls, wait ns) of its syncs: estimated with the sampled copies."""
        return self.sync_calls, int(self.work.get("sync_wait_ns", 0))

    def set_syncs(self, syncs: tuple[int, int]) -> None:
        """Its syncs as estimated (``syncs``'s form)."""
        self.sync_calls, wait = syncs
        self._set_work("sync_wait_ns", wait)

    def memsets(self) -> tuple[int, int]:
        """(calls, bytes) of its memsets."""
        return self.memset_calls, int(self.work.get("memset_bytes", 0))

    def set_memsets(self, memsets: tuple[int, int]) -> None:
        """Its memsets as estimated (``memsets``'s form)."""
        self.memset_calls, nbytes = memsets
        self._set_work("memset_bytes", nbytes)

    def _set_work(self, quantity: str, value: int) -> None:
        """One quantity of its work as estimated (a zero one left out, as seen)."""
        if value:
            self.work[quantity] = value
        else:
            self.work.pop(quantity, None)

    def counts(self) -> "StepCounts":
        """What ``--gpu-sample`` estimates of it, as it stands now."""
        return StepCounts(self.launches, int(self.work.get("graph_launches", 0)),
                          self.kernels, self.sampled_copies(), self.memsets(), self.syncs())

    def add(self, b: KernelBurst) -> None:
        if not self.bursts:
            self.first_ts = b.first_ts
            self.first_end_ts = b.last_ts
        self.memset_calls += b.memset_calls
        self.sync_calls += b.sync_calls
        self.query_polls += b.query_polls
        self.bursts += 1
        self.end_unseen = b.reason in UNSEEN_ENDS
        self.end_ts = max(self.end_ts, b.last_ts)
        self.bursts_ns += max(0, b.last_ts - b.first_ts)
        self.work.add(Work.of_burst(b, time_ns=0))
        self.kernels.update(b.handle_counts)
        for i, k in enumerate(COPY_KINDS):
            self.copy_calls[i] += b.copy_calls.get(k, 0)

    def add_stacks(self, samples: Counter[tuple[int, tuple[int, int]]]) -> None:
        """Stack samples taken in one of its bursts."""
        if self.stack_samples is None:
            self.stack_samples = Counter()
        self.stack_samples.update(samples)


@dataclass(frozen=True, slots=True)
class StepCounts:
    """What ``--gpu-sample`` estimates of a step (``Step.counts``)."""

    launches: int
    graph_launches: int
    kernels: Counter[int]
    sampled_copies: tuple[tuple[int, int], ...]  # (calls, bytes) per SAMPLED_COPY_KINDS
    memsets: tuple[int, int]  # (calls, bytes)
    syncs: tuple[int, int] = (0, 0)  # (calls, wait ns)


INTERVALS_KEPT = 256  # ~1-2 s of a busy engine's steps


@dataclass
class StepTotals:
    """What one thread's steps launched, copied (the sampled kinds) and memset, summed
    as they were booked (estimates included, under ``--gpu-sample``): the counts the GPU
    summary reports for an engine thread whose launches were sampled."""

    steps: int = 0
    estimated: int = 0  # steps whose launches are estimates
    launches: int = 0
    graph_launches: int = 0
    kernels: Counter[int] = field(default_factory=Counter)
    # SAMPLED_COPY_KINDS: kind -> calls, kind -> bytes
    copy_calls: Counter[str] = field(default_factory=Counter)
    copy_bytes: Counter[str] = field(default_factory=Counter)
    memset_calls: int = 0
    memset_bytes: int = 0
    sync_calls: int = 0
    sync_wait_ns: int = 0
    # the latest steps' intervals, one step's end to the next's (idle gaps included: a
    # window must span one to count a step whole), on the stream's clock
    intervals: deque[int] = field(default_factory=lambda: deque(maxlen=INTERVALS_KEPT))

    def book(self, step: Step, prev_end: int | None = None) -> None:
        """A step closed (after a step that ended at ``prev_end``): its launches,
        kernels and sampled copies as they stand."""
        if prev_end is not None and step.end_ts > prev_end:
            self.intervals.append(step.end_ts - prev_end)
        self.steps += 1
        self.estimated += step.estimated
        self.launches += step.launches
        self.graph_launches += int(step.work.get("graph_launches", 0))
        self.kernels.update(step.kernels)
        self._copies(step.sampled_copies(), 1)
        self._memsets(step.memsets(), 1)
        self._syncs(step.syncs(), 1)

    def interval_ns(self) -> int | None:
        """The mean of the latest steps' intervals, the longest 2% left out (a stall,
        a pause), or None before two steps: what a sampling window must span to count
        a step whole. The mean, not the median: an engine whose steps come in a short
        and a long kind (HF generate's: 0.5-0.7 and 5.5-7 ms) needs windows for both."""
        if not self.intervals:
            return None
        kept = sorted(self.intervals)[:len(self.intervals) - len(self.intervals) // 50]
        return sum(kept) // len(kept)

    def revise(self, step: Step, seen: StepCounts) -> None:
        """``step``, booked as ``seen``, has been estimated since."""
        self.estimated += 1
        self.launches += step.launches - seen.launches
        self.graph_launches += int(step.work.get("graph_launches", 0)) - seen.graph_launches
        self.kernels.subtract(seen.kernels)
        self.kernels.update(step.kernels)
        self._copies(seen.sampled_copies, -1)
        self._copies(step.sampled_copies(), 1)
        self._memsets(seen.memsets, -1)
        self._memsets(step.memsets(), 1)
        self._syncs(seen.syncs, -1)
        self._syncs(step.syncs(), 1)

    def _syncs(self, syncs: tuple[int, int], sign: int) -> None:
        self.sync_calls += sign * syncs[0]
        self.sync_wait_ns += sign * syncs[1]

    def _memsets(self, memsets: tuple[int, int], sign: int) -> None:
        self.memset_calls += sign * memsets[0]
        self.memset_bytes += sign * memsets[1]

    def _copies(self, copies: tuple[tuple[int, int], ...], sign: int) -> None:
        for k, (calls, nbytes) in zip(SAMPLED_COPY_KINDS, copies):
            if calls or nbytes:
                self.copy_calls[k] += sign * calls
                self.copy_bytes[k] += sign * nbytes


class StepLog:
    """The steps of one (pid, tid), in order; indices survive pruning."""

    def __init__(self, pid: int, tid: int) -> None:
        self.pid = pid
        self.tid = tid
        self.steps: list[Step] = []
        self.ends: list[int] = []
        self.base = 0  # index of steps[0]
        self.open: Step | None = None
        self.rank: int | None = None  # NCCL rank of its communicator, once seen
        self.comm_id: int | None = None
        # steps' first collectives in order: their signatures and steps
        self.coll_sigs: list[tuple[str, int, int]] = []
        self.coll_steps: list[int] = []
        self.coll_base = 0  # sequence number of coll_sigs[0]
        self.result_copies = False  # has a sync brought a device-to-host copy yet?

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.tid)

    @property
    def next_index(self) -> int:
        return self.base + len(self.steps)

    def add_burst(self, b: KernelBurst, stacks: Counter[tuple[int, tuple[int, int]]] | None = None
                  ) -> Step | None:
        """Add a burst (and the stack samples taken in it); returns the step it closed,
        if it ended one."""
        if self.open is None:
            self.open = Step(self.pid, self.tid)
        self.open.add(b)
        if stacks:
            self.open.add_stacks(stacks)
        ends, results = ends_step(b, self.result_copies)
        self.result_copies = self.result_copies or results
        if ends or self.open.end_ts - self.open.first_ts > OPEN_STEP_MAX_NS:
            return self._close()
        return None

    def add_nccl(self, ev: NcclEvent) -> None:
        """An NCCL call of this thread belongs to the step it was enqueued in."""
        if self.open is None:
            self.open = Step(self.pid, self.tid)
            self.open.first_ts = ev.ts_enter
        self.open.nccl_calls[ev.op] += 1
        if ev.bytes:
            self.open.work.add({"nccl_ops": 1, "nccl_bytes": ev.bytes})
        if ev.bytes and self.open.signature is None:
            self.open.signature = (ev.op, ev.count, ev.dtype)

    def finish(self) -> Step | None:
        """End of the stream: close the step still open, if it has any work (an NCCL
        call enqueued after the last burst is work too)."""
        if self.open is not None and (self.open.bursts or any(self.open.work.values())):
            return self._close()
        return None

    def _close(self) -> Step:
        step, self.open = self.open, None
        assert step is not None
        step.index = self.next_index
        step.work["gpu_time_ns"] = step.span_ns
        if step.signature is not None:
            step.coll_seq = self.coll_base + len(self.coll_sigs)
            self.coll_sigs.append(step.signature)
            self.coll_steps.append(step.index)
        self.steps.append(step)
        self.ends.append(step.end_ts)
        return step

    def prune(self, before_ts: int) -> list[Step]:
        """Forget steps that ended before ``before_ts``; returns them."""
        n = bisect_right(self.ends, before_ts - 1)
        gone = self.steps[:n]
        drop = sum(1 for st in gone if st.signature is not None)
        if drop:
            del self.coll_sigs[:drop]
            del self.coll_steps[:drop]
            self.coll_base += drop
        if n:
            del self.steps[:n]
            del self.ends[:n]
            self.base += n
        return gone

    def last_ended_by(self, ts: int) -> int:
        """Index of the last step that had ended at ``ts`` (base - 1 if none)."""
        return self.base + bisect_right(self.ends, ts) - 1

    def last_ended_by_each(self, times: Iterable[int]) -> list[int]:
        """``last_ended_by`` of each of ``times`` (a request's tokens: one list)."""
        ends, before = self.ends, self.base - 1
        return [before + bisect_right(ends, ts) for ts in times]

    def first_started_after(self, ts: int) -> int:
        """Index of the first step whose first launch is at or after ``ts``."""
        # steps are ordered by end and do not overlap within a thread, so by start too
        lo, hi = 0, len(self.steps)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.steps[mid].first_ts < ts:
                lo = mid + 1
            else:
                hi = mid
        return self.base + lo

    @property
    def has_collectives(self) -> bool:
        return bool(self.coll_sigs)

    def step_of_collective(self, seq: int) -> Step | None:
        """The step that issued collective number ``seq`` of this thread."""
        i = seq - self.coll_base
        return self.get(self.coll_steps[i]) if 0 <= i < len(self.coll_steps) else None

    def get(self, index: int) -> Step | None:
        i = index - self.base
        return self.steps[i] if 0 <= i < len(self.steps) else None


def collective_offset(leader: StepLog, follower: StepLog, window: int = 256,
                      max_shift: int = 64) -> int | None:
    """How the follower's collective numbers relate to the leader's: d such that the
    leader's collective i is the follower's i + d, or None if no shift fits.

    Tensor-parallel ranks issue the same collectives in the same order, but the
    tracer may attach while one rank is a collective ahead, and never see
    communicator init; so the shift is found by matching the two sequences of
    (op, count, type) over their latest ``window`` collectives (counts vary with the
    batch, which makes the pattern distinctive)."""
    a = leader.coll_sigs[-window:]
    a0 = leader.coll_base + len(leader.coll_sigs) - len(a)
    b = follower.coll_sigs
    need = max(2, min(len(a), len(b)) // 2)
    best: tuple[float, int] | None = None
    # the best share of matches wins; among equal shares the nearest shift (a run of
    # equal batches matches every shift, and ranks are rarely more than a step apart;
    # counting matches instead would favour the shift that overlaps a trailing rank's
    # shorter sequence most)
    for d in sorted(range(-max_shift, max_shift + 1), key=abs):
        matched = overlap = 0
        for i, sig in enumerate(a):
            j = a0 + i + d - follower.coll_base
            if 0 <= j < len(b):
                overlap += 1
                matched += b[j] == sig
        if overlap >= need and matched >= 0.9 * overlap:
            share = round(matched / overlap, 3)
            if best is None or share > best[0]:
                best = (share, d)
    return best[1] if best is not None else None
