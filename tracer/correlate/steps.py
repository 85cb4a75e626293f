"""Engine steps: a GPU thread's bursts grouped into the units a batching engine works in.

A continuous-batching engine runs steps: it launches one batched forward pass, waits
for it (one synchronisation), hands each request in the batch its next token, and
starts the next step. Seen from the probes, a step is a run of a thread's
``KernelBurst``s that ends with a burst flushed by a synchronisation; bursts flushed
by the interval timer or full handle slots only continue the step.

``StepLog`` keeps one thread's steps in order, numbered from 0, with their end times
indexed so that "the last step that had ended by time t" is a bisection. The
correlator (``tracer.correlate.attribution``) aligns each request's output tokens with
these indices; see ``request_range``.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from tracer.correlate.records import RequestRecord
from tracer.events.gpu import COPY_KINDS, KernelBurst, NcclEvent

MAX_STEPS = 200_000  # per thread: older steps are dropped first
OPEN_STEP_MAX_NS = 1_000_000_000  # a step with no sync for this long is closed anyway


@dataclass
class Step:
    """One engine step of one thread: sums of its bursts (and its NCCL calls)."""

    pid: int
    tid: int
    index: int = -1
    first_ts: int = 0
    end_ts: int = 0
    launches: int = 0
    graph_launches: int = 0
    copy_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COPY_KINDS, 0))
    sync_wait_ns: int = 0
    bursts: int = 0
    nccl_ops: int = 0
    nccl_bytes: int = 0
    charged: float = 0.0  # fractions of it charged to requests so far
    signature: tuple[str, int, int] | None = None  # (op, count, dtype) of its 1st collective
    coll_seq: int = -1  # that collective's place among its thread's collectives

    @property
    def span_ns(self) -> int:
        """First launch to the end of the step's wait: the GPU-time estimate."""
        return max(0, self.end_ts - self.first_ts)

    def add(self, b: KernelBurst) -> None:
        if not self.bursts:
            self.first_ts = b.first_ts
        self.bursts += 1
        self.end_ts = max(self.end_ts, b.last_ts)
        self.launches += b.launches
        self.graph_launches += b.graph_launches
        for k in COPY_KINDS:
            self.copy_bytes[k] += b.copy_bytes.get(k, 0)
        self.sync_wait_ns += b.sync_wait_ns


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

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.tid)

    @property
    def next_index(self) -> int:
        return self.base + len(self.steps)

    def add_burst(self, b: KernelBurst) -> Step | None:
        """Add a burst; returns the step it closed, if it ended one."""
        if self.open is None:
            self.open = Step(self.pid, self.tid)
        self.open.add(b)
        ends_step = b.sync_calls > 0 or b.reason in ("sync", "exit", "drain")
        if ends_step or self.open.end_ts - self.open.first_ts > OPEN_STEP_MAX_NS:
            return self._close()
        return None

    def add_nccl(self, ev: NcclEvent) -> None:
        """An NCCL call of this thread belongs to the step it was enqueued in."""
        if self.open is None:
            self.open = Step(self.pid, self.tid)
            self.open.first_ts = ev.ts_enter
        if ev.bytes:
            self.open.nccl_ops += 1
            self.open.nccl_bytes += ev.bytes
        if ev.bytes and self.open.signature is None:
            self.open.signature = (ev.op, ev.count, ev.dtype)

    def finish(self) -> Step | None:
        """End of the stream: close the step still open, if it has any work."""
        if self.open is not None and self.open.bursts:
            return self._close()
        return None

    def _close(self) -> Step:
        step, self.open = self.open, None
        assert step is not None
        step.index = self.next_index
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


def request_range(rec: RequestRecord, log: StepLog, finished: bool = True
                  ) -> tuple[int, int, str] | None:
    """The steps of ``log`` that served ``rec``: (first, last, how), or None.

    A streamed LLM response's k-th text chunk carries a token no earlier than the k-th
    the request got, and that token was made by a step that had ended before the chunk
    was written; so ``last_ended_by(chunk_k) - k`` bounds the request's first step from
    above, for every k, and hand-off lag only loosens each bound. The request then
    held one step per output token, consecutively (continuous batching keeps a
    running request in every step until it finishes). A request seen only as a whole
    response, or not an LLM request, holds the steps between its arrival and its
    response. Steps that started before the request had arrived are never its own.
    """
    arrival = rec.request_end_ns or rec.start_ns
    lower = log.first_started_after(arrival)
    r = rec.llm_response
    tokens = r.token_ts if r is not None else []
    n_out = (r.output_tokens or 0) if r is not None else 0
    if tokens and r is not None and r.streamed:
        n = max(len(tokens), n_out) if finished else len(tokens)
        cap = log.last_ended_by(tokens[-1])
        first = min(log.last_ended_by(ts) - k for k, ts in enumerate(tokens))
        first = min(first, cap - (n - 1))
        how = "tokens"
    elif n_out and finished:
        cap = log.last_ended_by(rec.response_start_ns or rec.end_ns)
        n = n_out
        first = cap - (n - 1)
        how = "response"
    else:
        if not finished:
            return None
        last = log.last_ended_by(rec.response_start_ns or rec.end_ns)
        return (lower, last, "time") if last >= lower else None
    if first < lower:  # tokens came faster than steps could make them: trust arrival
        first = lower
        how += "_clamped"
    last = min(first + n - 1, cap)
    return (first, last, how) if last >= first else None


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
    best: tuple[int, int] | None = None
    # nearest shifts first: a run of equal batches matches several shifts equally well,
    # and the ranks are rarely more than a step apart
    for d in sorted(range(-max_shift, max_shift + 1), key=abs):
        matched = overlap = 0
        for i, sig in enumerate(a):
            j = a0 + i + d - follower.coll_base
            if 0 <= j < len(b):
                overlap += 1
                matched += b[j] == sig
        if overlap >= 2 and matched >= 0.9 * overlap and (best is None or matched > best[0]):
            best = (matched, d)
    return best[1] if best is not None else None
