"""Which requests were in which engine step: tokens aligned with steps, and prefill.

A request's output shows when its tokens left the server, not which step made them;
``request_range`` turns its token times into the steps it must have been in
(``Occupancy``). ``Membership`` then walks one engine thread's steps in order and says,
for each, who was in it: the requests whose tokens place them there, and those
prefilling before their first token while the engine had a free slot, first come first
served (a long prompt's prefill is chunked over steps that show nothing outside the
process). Requests queued behind a full batch are in no step.

Steps per token: a continuous-batching engine gives each running request one token per
step, but a sequential ``generate`` loop may synchronise several times per token (HF
``transformers serve`` without continuous batching: three result copies per token). The
ratio is learned per thread from finished streamed requests (``StepsPerToken``).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

from tracer.correlate.costmodel import DECODING, Member, features
from tracer.correlate.records import RequestRecord
from tracer.correlate.steps import StepLog

RATIO_SAMPLES = 64  # recent requests the steps-per-token ratio is the median of
RATIO_MIN_SAMPLES = 1
RATIO_MIN_TOKENS = 8
PREEMPT_GAP = 3  # steps between two tokens beyond lag's reach: the request was preempted
CAPACITY_MIN_SHARE = 0.01  # a batch size seen in fewer steps than this is not capacity
CAPACITY_EVERY = 16  # steps between re-reading the capacity (and whenever requests join)


def arrival_ns(rec: RequestRecord) -> int:
    """When the request was all in: no step that started before can have served it."""
    return rec.request_end_ns or rec.start_ns


class PromptTokens:
    """A request's prompt tokens: from its response's usage, or the token ids it sent;
    else its prompt's characters times the tokens per character learned on this engine
    from requests that had both (a tokenizer's ratio: BPE English ~0.25, word-level
    vocabularies less), else its body bytes / 4. Only the proportions between requests
    matter to the cost model (a per-token coefficient absorbs any constant scale), so
    one engine's requests are all measured in the same unit."""

    DEFAULT = 0.25  # tokens per character until learned
    MIN_SAMPLES = 8

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=RATIO_SAMPLES)
        self.per_char = self.DEFAULT

    def learn(self, rec: RequestRecord) -> None:
        r, q = rec.llm_response, rec.llm_request
        if r is None or q is None or not r.input_tokens or not q.prompt_chars:
            return
        self.samples.append(r.input_tokens / q.prompt_chars)
        if len(self.samples) >= self.MIN_SAMPLES:
            self.per_char = statistics.median(self.samples)

    @staticmethod
    def exact(rec: RequestRecord) -> int | None:
        """The prompt tokens if known exactly (usage, or the token ids sent), else None."""
        r, q = rec.llm_response, rec.llm_request
        if r is not None and r.input_tokens:
            return int(r.input_tokens)
        if q is not None and q.prompt_token_ids:
            return int(q.prompt_token_ids)
        return None

    def of(self, rec: RequestRecord) -> float:
        exact = self.exact(rec)
        if exact:
            return float(exact)
        q = rec.llm_request
        if q is not None and q.prompt_chars:
            return q.prompt_chars * self.per_char
        return rec.request_bytes / 4.0


class PrefillChunk:
    """The engine's prefill chunk: the most prompt tokens one request prefills in one
    step (chunked prefill: full chunks, then the rest). A prompt of P tokens prefilled
    over k steps says ceil(P / C) == k. Placed from free batch slots, a prefill can look
    longer than its chunks (its hand-off to the engine lagged, or it queued), not
    shorter. So the chunk C kept is the one that agrees with the most requests whose
    prompts were long enough to be chunked (the smallest of equals), once there are
    ``MIN_SAMPLES`` of them, ``MIN_AGREE`` of them agree and at most ``MAX_SHORTER`` of
    them took fewer steps than C needs. Until then, or for a request it does not fit, a
    prompt's tokens are spread evenly over its prefill."""

    MIN_SAMPLES = 8
    MIN_AGREE = 0.5
    MAX_SHORTER = 0.1
    SAMPLES = 256

    def __init__(self) -> None:
        self.samples: deque[tuple[int, int]] = deque(maxlen=self.SAMPLES)  # (P, k >= 2)
        self.chunk: int | None = None
        self._since = 0

    def learn(self, tokens: int, steps: int) -> None:
        if tokens <= 0 or steps < 2:
            return  # one step says only C >= P: no chunking seen
        self.samples.append((tokens, steps))
        self._since += 1
        if len(self.samples) >= self.MIN_SAMPLES and self._since >= max(1, len(self.samples) // 8):
            self._since = 0
            self.chunk = self._best()

    def _best(self) -> int | None:
        best, agree = None, 0
        shorter_max = self.MAX_SHORTER * len(self.samples)
        for c in sorted({math.ceil(p / k) for p, k in self.samples}):
            need = [(math.ceil(p / c), k) for p, k in self.samples]
            n = sum(1 for want, k in need if want == k)
            if n > agree and sum(1 for want, k in need if k < want) <= shorter_max:
                best, agree = c, n
        return best if agree >= self.MIN_AGREE * len(self.samples) else None

    def steps(self, tokens: float) -> int | None:
        """The steps a prompt of ``tokens`` takes to prefill at the learned chunk
        (None until a chunk is learned)."""
        c = self.chunk
        return max(1, math.ceil(tokens / c)) if c and tokens > 0 else None

    def split(self, tokens: float, steps: int, j: int) -> float:
        """The prompt tokens of prefill step ``j`` (0-based) of ``steps``."""
        c = self.chunk
        if c is None or steps < 2 or math.ceil(tokens / c) != steps:
            return tokens / max(1, steps)
        return float(c) if j < steps - 1 else tokens - (steps - 1) * c


@dataclass(slots=True, eq=False)  # looked at per member per step: slots
class Occupancy:
    """The steps of one log one request was in.

    ``first``: the step that made its first token, the first its tokens place it in;
    ``last``: its last step; ``gaps``: runs of steps in between it was out of the batch
    (preempted); ``begin``: its first step once prefill is decided (<= ``first``);
    ``arrival``: the first step that started after it arrived."""

    rec: RequestRecord
    arrival: int
    first: int
    last: int
    how: str
    begin: int | None = None
    gaps: tuple[tuple[int, int], ...] = ()
    by_tokens: bool = field(init=False)  # placed by its tokens (fixed): not "time"
    share: object | None = field(init=False, default=None)  # the attribution's GpuShare

    def __post_init__(self) -> None:
        self.by_tokens = not self.how.startswith("time")

    def holds(self, i: int) -> bool:
        """Its tokens place it in step ``i``."""
        return self.first <= i <= self.last and not (
            self.gaps and any(a <= i <= b for a, b in self.gaps))

    @property
    def start(self) -> int:
        """First step it is charged for (``begin`` once decided, else ``first``)."""
        return self.begin if self.begin is not None else self.first


@dataclass(slots=True)
class StepMembers:
    """The members of one step: those decoding (``DECODING``: they all cost the same, so
    they are counted, not described) and the others (prefilling), each with its
    ``Member``."""

    decoding: list[Occupancy]
    others: list[tuple[Occupancy, Member]]
    by_tokens: bool = False  # one of them is placed by its tokens (not all by time)

    def __len__(self) -> int:
        return len(self.decoding) + len(self.others)

    def features(self) -> tuple[float, float, float]:
        """``costmodel.features`` of the step."""
        n, prefilling, tokens = features([m for _, m in self.others])
        return n + len(self.decoding), prefilling, tokens


def request_range(rec: RequestRecord, log: StepLog, per_token: int = 1,
                  finished: bool = True, lag_ns: int = 0) -> Occupancy | None:
    """The steps of ``log`` that served ``rec``, from its tokens.

    A streamed response's k-th text chunk carries a token no earlier than the k-th,
    made by a step that had ended before the chunk was written; so
    ``last_ended_by(chunk_k) - k`` bounds the step of its first token from above, for
    every k (hand-off lag only loosens each bound), and its last step ended before its
    last chunk. Where the engine gives a running request one token per step
    (``per_token`` 1: continuous batching), the output token count pins the range
    further: the first step is at most the last minus (tokens - 1), the last at most the
    first plus (tokens - 1), and a response seen only whole spans its output tokens'
    steps up to its response. Where a token takes several steps (a sequential
    ``generate`` loop, whose steps per token vary with streaming), only the times are
    used, and a whole response is placed by ``Membership`` after the request before it.
    ``lag_ns``: the least hand-off lag from an engine step's end to the API's write of
    what it made (``HandOffLag``), by which a whole response's last step ended before
    it was written.
    A request with neither tokens nor a response (not an LLM request, or no usage)
    holds the steps between its arrival and its response ("time"). Steps that started
    before the request arrived are never its own.
    """
    lower = log.first_started_after(arrival_ns(rec))
    r = rec.llm_response
    tokens = r.token_ts if r is not None else []
    n_out = (r.output_tokens or 0) if r is not None else 0
    batching = per_token <= 1
    if tokens and r is not None and r.streamed:
        n = max(len(tokens), n_out) if finished else len(tokens)
        ends = log.last_ended_by_each(tokens)
        if batching and n == len(tokens) and len(tokens) > 1:
            runs = token_runs(ends)
            if len(runs) > 1:  # preempted between runs of tokens
                lo = max(runs[0][0], lower)
                if runs[-1][1] < lo:
                    return None
                gaps = tuple((a[1] + 1, b[0] - 1) for a, b in zip(runs, runs[1:]))
                return Occupancy(rec, lower, lo, runs[-1][1], "tokens_preempted", gaps=gaps)
        cap = ends[-1]
        first = min(e - k for k, e in enumerate(ends))
        if batching:
            first = min(first, cap - (n - 1))
        how = "tokens"
    elif n_out and finished:
        # a whole response left ``lag_ns`` (the engine-to-API hand-off, learned from
        # streamed requests) after its last step at least
        cap = log.last_ended_by((rec.response_start_ns or rec.end_ns) - lag_ns)
        n = n_out
        first = cap - (n - 1) if batching else cap
        how = "response"
    else:
        if not finished:
            return None
        last = log.last_ended_by(rec.response_start_ns or rec.end_ns)
        if last < lower:
            return None
        return Occupancy(rec, lower, lower, last, "time", begin=lower)
    if first < lower:  # tokens came faster than steps could make them: trust arrival
        first = lower
        how += "_clamped"
    last = min(first + n - 1, cap) if batching else cap
    return Occupancy(rec, lower, first, last, how) if last >= first else None


def token_runs(ends: list[int]) -> list[tuple[int, int]]:
    """A one-token-per-chunk stream's steps as runs of consecutive steps: (first, last)
    each. ``ends[k]`` is the last step ended before chunk k was written; each token is
    placed as late as it and the tokens after it allow (one step apart), so a chunk
    written late does not pull its neighbours; a jump of more than ``PREEMPT_GAP``
    steps between two tokens is a preemption, not lag. Each run is then placed as
    early as its least-delayed token allows."""
    late = list(ends)
    for k in range(len(late) - 2, -1, -1):
        late[k] = min(late[k], late[k + 1] - 1)
    runs, start = [], 0
    for k in range(1, len(late) + 1):
        if k == len(late) or late[k] - late[k - 1] > 1 + PREEMPT_GAP:
            first = min(ends[j] - (j - start) for j in range(start, k))
            runs.append((first, first + (k - 1 - start)))
            start = k
    return runs


class StepsPerToken:
    """Steps a request spends per output token on one engine thread: 1 for continuous
    batching, more where each token takes several result copies. Per finished
    streamed request, the median number of steps between consecutive text chunks
    (robust to a chunk written late, to a chunk carrying two tokens and to a
    preemption); per thread, the rounded median of the recent requests' values."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=RATIO_SAMPLES)
        self.value = 1

    def learn(self, rec: RequestRecord, log: StepLog) -> None:
        r = rec.llm_response
        if r is None or not r.streamed or len(r.token_ts) < RATIO_MIN_TOKENS:
            return
        ends = log.last_ended_by_each(r.token_ts)
        self.samples.append(statistics.median(b - a for a, b in zip(ends, ends[1:])))
        if len(self.samples) >= RATIO_MIN_SAMPLES:
            self.value = max(1, round(statistics.median(self.samples)))


class HandOffLag:
    """How long after the step that made it a token is written, at the least: a low
    quantile over recent streamed requests of (last chunk written - end of the step
    their tokens place last). Whole responses show one time only; this keeps a busy
    API process's slow write from placing them in later steps."""

    QUANTILE = 0.2

    def __init__(self) -> None:
        self.samples: deque[int] = deque(maxlen=RATIO_SAMPLES)
        self.value = 0

    def learn(self, occ: Occupancy, log: StepLog) -> None:
        r = occ.rec.llm_response
        step = log.get(occ.last)
        if r is None or not r.token_ts or step is None or not occ.how == "tokens":
            return
        self.samples.append(max(0, r.token_ts[-1] - step.end_ts))
        ordered = sorted(self.samples)
        self.value = ordered[int(self.QUANTILE * (len(ordered) - 1))]


class Membership:
    """The members of one log's steps, decided in step order.

    ``add`` takes a finished request's occupancy; ``members(i)`` says who was in step
    ``i`` (called for i = 0, 1, 2, ... as steps are settled). Prefill is contiguous and
    ends with the first token: a request that had arrived before the step of its first
    token was prefilling in each step back from that one while the step had a free slot
    (fewer requests in it than the engine's batch capacity), and queued before; earlier
    arrivals take free slots first. This is decided for a request at the first step
    settled after it arrived, and needs every step up to its first token to have its
    members known: ``horizon(i)`` says how far that is. The capacity is learned: the
    most requests tokens place in one step, except in the rarest steps."""

    def __init__(self, log: StepLog) -> None:
        self.log = log
        self.occupancies: dict[tuple[int, int, int, int], Occupancy] = {}
        self.capacity = 1
        self.counts: Counter[int] = Counter()  # settled steps by requests their tokens place in them
        self.committed: Counter[int] = Counter()  # step -> requests decided to prefill in it
        # step -> requests tokens place in it, from step ``_next`` on: kept up to date as
        # occupancies come and go (rebuilt when members() is asked out of order)
        self._ahead: Counter[int] | None = None
        self._next = 0  # the step members() is asked for next
        self._joined = True  # occupancies came or went since members() last ran
        # occupancies whose prefill is still to be placed (by tokens, no ``begin``)
        self._unplaced: dict[tuple[int, int, int, int], Occupancy] = {}
        self._seq: dict[tuple[int, int, int, int], int] = {}  # key -> order it joined in
        self._joins = 0
        self.ratio = StepsPerToken()
        self.lag = HandOffLag()
        self.prompt = PromptTokens()
        self.chunk = PrefillChunk()

    def add(self, occ: Occupancy) -> None:
        key = occ.rec.key
        old = self.occupancies.get(key)
        if old is not None:
            self._count_ahead(old, -1)
        else:
            self._seq[key] = self._joins
            self._joins += 1
        self.occupancies[key] = occ
        self.prompt.learn(occ.rec)
        self._count_ahead(occ, 1)
        if occ.by_tokens and occ.begin is None:
            self._unplaced[key] = occ
        else:
            self._unplaced.pop(key, None)
        self._joined = True

    def remove(self, key: tuple[int, int, int, int]) -> Occupancy | None:
        occ = self.occupancies.pop(key, None)
        self._unplaced.pop(key, None)
        self._seq.pop(key, None)
        if occ is not None:
            self._count_ahead(occ, -1)
        self._joined = True
        return occ

    def _count_ahead(self, o: Occupancy, by: int) -> None:
        """Add (or take away) ``o``'s steps from ``_next`` on to ``_ahead``."""
        ahead = self._ahead
        if ahead is None or not o.by_tokens:
            return
        for k in range(max(o.first, self._next), o.last + 1):
            if o.holds(k):
                n = ahead[k] + by
                if n:
                    ahead[k] = n
                else:
                    del ahead[k]

    def horizon(self, i: int) -> int:
        """The last step whose members must be known before step ``i`` is settled: the
        step before the first token of any request still to be placed by then."""
        out = i
        for o in self._unplaced.values():
            if o.arrival <= i < o.first:
                out = max(out, o.first - 1)
        return out

    def members(self, i: int) -> StepMembers:
        """Who was in step ``i``, with what the cost model needs to know of each."""
        rebuilt = self._ahead is None or self._next != i or self._joined
        self._joined = False
        ahead = self._emitting_ahead(i)
        emitting = ahead.pop(i, 0)
        self.counts[emitting] += 1
        if rebuilt or i % CAPACITY_EVERY == 0:
            self._learn_capacity(ahead)
        seq = self._seq  # ties in the order requests joined (as ``occupancies`` holds them)
        undecided = sorted((o for o in self._unplaced.values() if o.arrival <= i),
                           key=lambda o: (arrival_ns(o.rec), seq[o.rec.key]))
        for o in undecided:  # earlier arrivals first
            self._place(o, i, ahead, emitting)
            del self._unplaced[o.rec.key]
        self.committed.pop(i - 1, None)
        self._next = i + 1
        out = StepMembers([], [])
        decoding = out.decoding.append
        for o in self.occupancies.values():  # per step: the conditions of holds, _member
            if not o.by_tokens:
                if o.arrival <= i <= o.last:
                    decoding(o)
            elif o.first < i <= o.last:
                if not o.gaps or o.holds(i):
                    decoding(o)
                    out.by_tokens = True
            elif i == o.first or o.begin is not None and o.begin <= i < o.first:
                out.others.append((o, self._member(o, i)))
                out.by_tokens = True
        return out

    def _place(self, o: Occupancy, i: int, ahead: Counter[int], now: int) -> None:
        """Decide where ``o``'s prefill began: back from its first token while steps had
        a free slot, not before step ``i`` (those are settled) or its arrival. ``now``:
        the requests tokens place in step ``i``."""
        free = o.first
        while free - 1 >= max(o.arrival, i):
            j = free - 1
            used = (ahead.get(j, 0) if j != i else now) + self.committed[j]
            if used >= self.capacity:
                break
            free = j
        # Once the engine's chunk is known, a prompt prefills in no more steps than its
        # chunks: free slots between the request's arrival and those steps are its
        # hand-off to the engine (another process, a tokenizer), not its prefill. An
        # estimated prompt gets one step more, for the estimate's error. The chunk is
        # learned from the free slots alone, so a wrong chunk cannot confirm itself.
        exact = self.prompt.exact(o.rec)
        need = self.chunk.steps(self.prompt.of(o.rec))
        a = max(free, o.first - need + (1 if exact else 0)) if need else free
        o.begin = a
        for j in range(a, o.first):
            self.committed[j] += 1
        if exact:
            self.chunk.learn(exact, o.first - free + 1)

    def _emitting_ahead(self, i: int) -> Counter[int]:
        """Step -> requests its tokens place in it, for steps from ``i`` on (kept
        between calls; the caller pops step ``i`` once it has read it)."""
        if self._ahead is None or self._next != i:
            self._ahead = Counter()
            for o in self.occupancies.values():
                if o.by_tokens:
                    for k in range(max(o.first, i), o.last + 1):
                        if o.holds(k):
                            self._ahead[k] += 1
        return self._ahead

    def _learn_capacity(self, ahead: Counter[int]) -> None:
        """The batch capacity: the most requests tokens place in one step, counting
        only numbers reached in at least ``CAPACITY_MIN_SHARE`` of the steps (settled,
        and those the known tokens cover ahead) and at least twice. Rarer peaks are a
        request's tokens written late overlapping the next one's steps, not room in
        the batch."""
        counts = self.counts + Counter(ahead.values())
        need = max(2.0, CAPACITY_MIN_SHARE * sum(counts.values()))
        reached = 0
        for n in sorted(counts, reverse=True):
            reached += counts[n]
            if reached >= need:
                self.capacity = max(1, n)
                return
        self.capacity = max([1, *counts])

    def _member(self, o: Occupancy, i: int) -> Member:
        if not o.by_tokens or i > o.first:
            return DECODING
        return Member(prefill=True, tokens=self.chunk.split(
            self.prompt.of(o.rec), o.first - o.start + 1, i - o.start))
