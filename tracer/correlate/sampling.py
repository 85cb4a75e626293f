"""Launch-count estimates under ``--gpu-sample``: the launch probes are attached for a
share of each period, the copy, memset and sync probes all the time (but those of the
host-to-device and device-to-device copies and of the syncs, switched with the launch
probes where a thread's steps are told apart without them: ``GpuSampling.copies``,
``StepEstimates.copies_tell_steps_apart``; and the memsets', on their own:
``GpuSampling.memsets``, ``StepEstimates.memsets_tell_steps_apart``). While the syncs
are off a step ends at its device-to-host copy (``steps.ends_step``).

The estimate is a ratio over steps. A thread's step ends where its work is known to be
done (a burst flushed by a synchronisation or a query that found the work finished);
steps are counted exactly, sampled or not. A step that lies wholly inside one window
in which the launch probes were on is a sample: its launches were all seen. The
thread's launches are then

    launches seen in sampled steps / sampled steps x all steps

so the estimate does not depend on how fast the thread ran while the probes were on
(attaching and detaching can slow or stall the target, which made the older
time-share estimate 90 % low on a real GPU). A thread with too few sampled steps (one
that never synchronises, or a short capture) falls back to the time share: launches
seen divided by the share of its active span the probes were on; ``method`` says which.

Per request, the same question is asked of each engine step (``StepEstimates``): a step
the launch probes did not see whole takes its launches, kernels and span from a
wholly seen step of the same thread and shape (the calls the probes that stay on saw:
copies by kind and syncs, but those switched with the launches), the one whose copies
moved the nearest bytes, so each
request's kernel counts and GPU time are estimates too, and charged plus unattributed
still equals observed.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter, deque
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Mapping

from tracer.correlate.steps import UNSEEN_ENDS, Step
from tracer.events.gpu import COPY_KINDS, SAMPLED_COPY_KINDS, SHAPE_COPY_KINDS

D2H = COPY_KINDS.index("d2h")

# fewer sampled steps than this and the step ratio is too noisy: use the time share
MIN_SAMPLED_STEPS = 8

STEP_ENDS = frozenset({"sync", "copy", "query", "exit", "drain"})


@dataclass
class LaunchSampling:
    """The on/off switches of the launch probes, in order, and what each cost."""

    fraction: float  # configured share of each period
    switches: list[tuple[int, bool]] = field(default_factory=list)  # (ts, on)
    attach_s: list[float] = field(default_factory=list)
    detach_s: list[float] = field(default_factory=list)
    # whether the SAMPLED_COPY_KINDS copies and the syncs were switched with the
    # launches, per switch
    copies: list[bool] = field(default_factory=list)
    memsets: list[bool] = field(default_factory=list)  # and the memsets

    _ts: list[int] = field(default_factory=list)  # the switches' times, for bisect
    # spans with every probe out (``ctl pause``): not time the launch probes were on
    # or off, and left out of the share measured
    paused: list[tuple[int, int]] = field(default_factory=list)
    _paused_since: int | None = None
    _on_at_pause: bool = False

    def switch(self, ts: int, on: bool, attach_s: float = 0.0, detach_s: float = 0.0,
               copies: bool = False, memsets: bool = False) -> None:
        self.switches.append((ts, on))
        self._ts.append(ts)
        self.copies.append(copies)
        self.memsets.append(memsets)
        if on and attach_s:
            self.attach_s.append(attach_s)
        if detach_s:
            self.detach_s.append(detach_s)

    def pause(self, ts: int, paused: bool) -> None:
        """The agent took every probe out (``paused``) or put them back. A pause is an
        "off" switch: no launch in it was counted, so no step across it is whole. The
        resume puts the launch probes back as they were (stamped once they are in), and
        the next toggle goes on from there."""
        if paused and self._paused_since is None:
            self._paused_since = ts
            self._on_at_pause = bool(self.switches) and self.switches[-1][1]
            if self._on_at_pause:
                self.switch(ts, False, copies=self.copies[-1], memsets=self.memsets[-1])
        elif not paused and self._paused_since is not None:
            self.paused.append((self._paused_since, ts))
            self._paused_since = None
            if self._on_at_pause:
                self.switch(ts, True, copies=self.copies[-1], memsets=self.memsets[-1])

    def _paused_ns(self, a: int, b: int) -> int:
        """How much of [a, b] the agent was paused."""
        return sum(max(0, min(e, b) - max(p, a)) for p, e in self.paused)

    def _at(self, flags: list[bool], ts: int) -> bool:
        """``flags`` (one per switch) as the last switch at or before ``ts`` said."""
        i = bisect_right(self._ts, ts)
        return flags[i - 1] if i else False

    def copies_at(self, ts: int) -> bool:
        """Whether the sampled copies went on and off with the launch probes
        at ``ts`` (as the last switch at or before it said)."""
        return self._at(self.copies, ts)

    @property
    def copies_ever(self) -> bool:
        """Whether any switch had the sampled copies switched too."""
        return any(self.copies)

    def memsets_at(self, ts: int) -> bool:
        """Whether the memsets went on and off with the launch probes at ``ts``."""
        return self._at(self.memsets, ts)

    @property
    def memsets_ever(self) -> bool:
        """Whether any switch had the memsets switched too."""
        return any(self.memsets)

    def _on_ns(self, a: int, b: int) -> int:
        """How much of [a, b] the launch probes were on."""
        on = 0
        since: int | None = None
        for ts, enabled in self.switches:
            if enabled and since is None:
                since = ts
            elif not enabled and since is not None:
                on += max(0, min(ts, b) - max(since, a))
                since = None
        if since is not None:
            on += max(0, b - max(since, a))
        return on

    def on_share(self, a: int, b: int) -> float:
        """The share of [a, b] the launch probes were on (1.0 for an empty span)."""
        if b <= a:
            return 1.0
        return self._on_ns(a, b) / (b - a)

    def _traced_on_share(self, a: int, b: int) -> float:
        """``on_share`` of [a, b] with the paused spans left out of it."""
        if b <= a:
            return 1.0
        traced = (b - a) - self._paused_ns(a, b)
        if traced <= 0:
            return 0.0
        return min(1.0, self._on_ns(a, b) / traced)

    def counted(self, a: int, b: int) -> bool:
        """Whether every launch in [a, b] was counted: the probes were on at ``a`` (as
        they are before the first switch: sampling starts from exact counting) and
        were not switched off in (a, b]. Switches are stamped by the agent before a
        detach and after an attach, so a counted span is never wider than the time the
        probes really counted."""
        # once per step, so by bisection: a long sampled run has thousands of switches
        i = bisect_right(self._ts, a)
        if i and not self.switches[i - 1][1]:
            return False
        j = bisect_right(self._ts, b)
        return all(on for _, on in self.switches[i:j])

    def summary(self) -> dict[str, Any]:
        sw = self.switches
        out: dict[str, Any] = {
            "estimated": True, "fraction": self.fraction, "switches": len(sw),
            "copies_sampled": self.copies_ever, "memsets_sampled": self.memsets_ever,
            "measured_on_share": round(self._traced_on_share(sw[0][0], sw[-1][0]), 6)
            if sw else 0.0,
        }
        for name, xs in (("attach_ms", self.attach_s), ("detach_ms", self.detach_s)):
            if xs:
                out[name] = {"mean": round(1e3 * sum(xs) / len(xs), 3),
                             "max": round(1e3 * max(xs), 3)}
        return out


@dataclass
class StepSample:
    """One thread's steps under sampling: how many there were, and the launches (and
    sampled copies) of those wholly inside an "on" window."""

    steps: int = 0
    sampled_steps: int = 0
    # launches the thread made before sampling began (``--control gpu-sample`` while
    # running): all counted, so exact, and outside the steps above
    exact_launches: int = 0
    exact_graph_launches: int = 0
    sampled_launches: int = 0
    sampled_graph_launches: int = 0
    # the same for the copies sampled with the launches: "calls.KIND" / "bytes.KIND"
    exact_copies: Counter[str] = field(default_factory=Counter)
    sampled_copies: Counter[str] = field(default_factory=Counter)
    # the step being built: bursts since the last step end (interval flushes split one)
    _start: int = 0
    _launches: int = 0
    _graphs: int = 0
    _copies: Counter[str] = field(default_factory=Counter)
    results: bool = False  # a sync (or the copy) has brought results back

    def add(self, reason: str, first_ts: int, last_ts: int, launches: int,
            graph_launches: int, sampling: LaunchSampling,
            copies: Mapping[str, int] | None = None, d2h: int = 0) -> None:
        """One burst: its launches, its sampled copies (``sampled_copy_counts``) and
        its device-to-host copies."""
        if not self._start:
            self._start = first_ts
        self._launches += launches
        self._graphs += graph_launches
        if copies:
            self._copies.update(copies)
        if reason not in STEP_ENDS:
            return
        if reason in ("sync", "copy"):
            # as StepLog ends steps: once results came back at a sync, a sync without
            # them is inside a step (where it flushes: no uprobe sessions), and while
            # the syncs are off each step ends at its result copy instead, once
            if not d2h and self.results:
                return
            self.results = self.results or d2h > 0
        self.steps += 1
        # a step whose end went unseen (Step.end_unseen) is no sample of its kind
        if sampling.counted(self._start, last_ts) and reason not in UNSEEN_ENDS:
            self.sampled_steps += 1
            self.sampled_launches += self._launches
            self.sampled_graph_launches += self._graphs
            self.sampled_copies.update(self._copies)
        # the next step starts where this one ended: a launch before the next burst
        # opens would otherwise be missed by the "wholly on" test
        self._start = last_ts
        self._launches = self._graphs = 0
        self._copies.clear()

    def scale(self) -> float | None:
        """The factor from launches in sampled steps to all launches (all steps /
        sampled steps); None when too few steps were sampled."""
        if self.sampled_steps < MIN_SAMPLED_STEPS:
            return None
        return self.steps / self.sampled_steps


def sampled_copy_counts(copy_calls: Mapping[str, int], copy_bytes: Mapping[str, int],
                        memset_calls: int = 0, memset_bytes: int = 0, sync_calls: int = 0,
                        sync_wait_ns: int = 0) -> dict[str, int]:
    """The calls and bytes of the copy kinds sampled with the launches
    (``SAMPLED_COPY_KINDS``), keyed "calls.KIND" and "bytes.KIND", of the memsets
    ("calls.memset", "bytes.memset") and the syncs' calls and wait ("calls.sync",
    "wait.sync"), zeros left out."""
    out = {}
    if sync_calls:
        out["calls.sync"] = sync_calls
    if sync_wait_ns:
        out["wait.sync"] = sync_wait_ns
    for k in SAMPLED_COPY_KINDS:
        if copy_calls.get(k):
            out[f"calls.{k}"] = copy_calls[k]
        if copy_bytes.get(k):
            out[f"bytes.{k}"] = copy_bytes[k]
    if memset_calls:
        out["calls.memset"] = memset_calls
    if memset_bytes:
        out["bytes.memset"] = memset_bytes
    return out


def estimate(seen: float, sampled: float, sample: StepSample | None,
             sampling: LaunchSampling, first_ts: int, last_ts: int,
             exact: float = 0.0) -> tuple[float, str]:
    """(estimated count, method) for a thread that saw ``seen`` launches of which
    ``sampled`` fell in sampled steps and ``exact`` came before sampling began."""
    # a thread whose steps no result copy ended has none at all while the syncs are off
    # with the copies: its steps then say nothing of its launches
    blind = sampling.copies_ever and (sample is None or not sample.results)
    factor = sample.scale() if sample is not None and not blind else None
    if factor is not None:
        return exact + sampled * factor, "steps"
    if exact and sampling.switches:
        first_ts = max(first_ts, sampling.switches[0][0])
    share = sampling.on_share(first_ts, last_ts)
    rest = seen - exact
    return exact + (rest / share if share > 0 else rest), "time_share"


# a step's start when its launches were not seen: after the previous step's end by the
# reference's gap, but not before its first burst's end by more than this many times the
# reference's first burst (an engine that idled between steps); chosen on the H100
# captures, where it puts the summed span within 1.5% (bench/sampling_error.py). With
# the syncs sampled too no sync splits the step's bursts, so its first ends at its
# result copy: not before its end by this many times the reference's span
FIRST_BURST_SLACK = 4
# A reference's gap is what the engine spent between steps when it had work. A step
# that followed an idle spell or a stall (no request; a pause: HF serve on an H100
# stopped 341 ms between two steps with requests in flight) put every later step of
# its shape that far after its predecessor's end, so their starts met their ends (GPU
# time ~0) until a window saw another of the shape whole. A gap over this many times
# the thread's median gap, and over the step's own span, is taken for idle, and the
# reference keeps the median instead. HF serve CB's gaps on H100s: median 2.4-4.1 ms,
# 99% within 4.7-11 ms, the longest 23-31 ms (prefills, mostly shorter than their
# steps: 1-3 of ~2,000 steps a run are taken for idle); HF generate idles between
# requests (109 of its steps: per-request GPU time p90 error 2.7% -> 1.4%)
IDLE_GAP_FACTOR = 4
GAP_HISTORY = 64  # per thread, the latest gaps learned (the median's)
GAP_MIN_HISTORY = 8  # fewer: a gap over the step's own span is taken for idle
MAX_SHAPES = 256  # per thread, least recently seen forgotten first
MAX_SIZES = 16  # per shape: the latest steps of different copy sizes


@dataclass(frozen=True, slots=True)
class StepReference:
    """What a wholly seen step tells about the next ones of its shape."""

    launches: int
    graph_launches: int
    kernels: Counter[int]
    gap_ns: int  # previous step's end to its first launch
    first_burst_ns: int  # its first launch to its first burst's end
    copies: tuple[tuple[int, int], ...]  # (calls, bytes) per SAMPLED_COPY_KINDS
    span_ns: int = 0  # its first launch to its end
    memsets: tuple[int, int] = (0, 0)  # (calls, bytes)
    syncs: tuple[int, int] = (0, 0)  # (calls, wait ns)


ThreadKey = tuple[int, int]  # (pid, tid)
Shapes = dict[tuple[int, ...], dict[tuple[int, ...], StepReference]]
# Copies (SAMPLED_COPY_KINDS) are sampled with the launches only where the other probes
# tell a thread's steps apart as well without them: where launches estimated without
# them (over the steps counted whole) were off by more than this share of the launches,
# they stay probed. HF serve --continuous-batching (H100 captures): 0.8-1.4%, its
# batch size shows in its tokens' copy back as well; HF generate (plain serve): 29%,
# three kinds of step with one shape but for these copies (143, 5 and 2 launches).
BLIND_ERROR = 0.03
# ... and where the bytes of any one kind, estimated so, were off by more than this
# share: a copy made in a few steps only is not told by its steps' shapes (HF serve CB:
# 2-3%)
BLIND_COPY_ERROR = 0.1
BLIND_MIN_STEPS = 50  # steps counted whole and compared before the shares decide
# Memsets are sampled with the launches (on their own) only where each step counted
# whole made the memset bytes its shape makes on average, to within this share in all:
# HF serve CB makes ~9 a step on the lent hosts, one in a few steps on the H100 captures
# (~100% off there, so they stay probed). Against the shape's mean, not the latest step
# of the shape: memsets that come in runs of steps look predictable from the step
# before, but not from a reference up to a period old (the fixture: 4.9% off from the
# step before, totals 21-58% of the truth sampled)
BLIND_MEMSET_ERROR = BLIND_COPY_ERROR
# ... or where that error, however large a share of the memsets, is under this share of
# all the bytes the steps moved (copies and memsets): HF serve CB's memsets follow
# requests joining and leaving its batch more than its steps' shapes, but they are
# 0.1-0.3% of its steps' bytes on the H100 captures, so estimated they cost a request's
# bytes moved little, and probed they were ~30% of the GPU traps left (4xH100, c8)
BLIND_MEMSET_MOVED = 0.01
# ... or where the error of runs of consecutive steps counted whole, as many as the
# typical request is in (the longest of RUN_LENGTHS within the median of the requests
# released so far), each run's memset bytes against its steps' shape means summed, is
# within BLIND_MEMSET_ERROR of their memset bytes: a request's memset bytes are its
# shares of the steps it is in, so a step's memsets above its shape's mean and the
# next one's below cancel in what it is charged. HF serve CB, an exact c8 capture on
# 4 H200s (bench/sampling_error.py): its memsets 14% of the bytes its steps moved, a
# step's 15.7% off its shape's mean (2.2% of the bytes moved), runs of 4/8/16/32/64
# steps 11.8/8.2/5.5/3.3/2.3%, and each request's memset bytes imposed sampled 1.3%
# off at the median, 5% at p90.
# Where memsets come in one run of steps (the H100 captures' batch draining), runs of
# 16 are as far off as single steps (42% and 24%)
RUN_LENGTHS = (4, 8, 16, 32, 64)
MAX_MEMSET_SHAPES = 4096  # (thread, shape) means kept; all forgotten past this


class StepEstimates:
    """Per thread, the latest wholly seen steps of each shape, and the estimates they
    give the steps the launch probes did not see whole: from the step's own shape (of
    those, the one whose copies moved the nearest number of bytes: an engine whose
    launches grow with the batch copies more for a bigger one), or, for a shape not seen
    whole yet, the nearest one. Own-shape estimates are within 0.2% on the H100
    captures, nearest-shape ones 11-18% (a batch's size changes its copies and
    launches, but not in one proportion); the longer the run, the more shapes have been
    seen whole.

    References are kept twice: by the shape every copy probe saw, and by the shape
    without the copies sampled with the launches (``SAMPLED_COPY_KINDS``), for when
    they are. Each step counted whole is first estimated as if they had been sampled,
    so that ``copies_tell_steps_apart`` can say whether sampling them would cost the
    estimates."""

    def __init__(self) -> None:
        # copies sampled? -> thread -> shape -> copy sizes -> reference; shapes and
        # sizes most recent last
        self.refs: dict[bool, dict[ThreadKey, Shapes]] = {False: {}, True: {}}
        # thread -> [steps, |launches estimated without the sampled copies - counted|,
        # launches counted, then per SAMPLED_COPY_KINDS |its bytes so estimated -
        # counted|, its bytes counted], over the steps counted whole
        self.blind: dict[ThreadKey, list[int]] = {}
        # thread -> [|its shape's mean memset bytes so far - counted|, memset bytes
        # counted, all bytes moved (copies and memsets)]
        self.blind_memsets: dict[ThreadKey, list[float]] = {}
        # thread -> per RUN_LENGTHS, over its whole runs: [|the sum of (mean -
        # counted)|, memset bytes counted], and the run under way: [steps, sum, bytes]
        self.blind_memset_runs: dict[ThreadKey, list[list[float]]] = {}
        self._memset_runs: dict[ThreadKey, list[list[float]]] = {}
        # (thread, shape without the sampled copies[, the bytes of the copies still
        # probed]) -> [steps, memset bytes, calls]
        self._memset_means: dict[tuple[Any, ...], list[int]] = {}
        # thread -> the latest gaps learned, not taken for idle
        self._gaps: dict[ThreadKey, deque[int]] = {}

    def learn(self, step: Step, prev_end: int | None) -> bool:
        """``step`` was counted whole: it is its shape's (and size's) reference.
        True where its gap was taken for idle (``IDLE_GAP_FACTOR``)."""
        if prev_end is None:
            return False  # no gap to learn from
        gap, idle = self._gap(step, prev_end)
        ref = StepReference(launches=step.launches,
                            graph_launches=int(step.work.get("graph_launches", 0)),
                            kernels=step.kernels, gap_ns=gap,
                            first_burst_ns=max(0, step.first_end_ts - step.first_ts),
                            span_ns=step.span_ns,
                            copies=step.sampled_copies(), memsets=step.memsets(),
                            syncs=step.syncs())
        key = (step.pid, step.tid)
        blind_shape = step.shape(True)
        blind = self.refs[True].get(key)
        if blind:
            guess = _reference(blind, blind_shape, _copy_sizes(step, True))
            err = self.blind.setdefault(key, [0] * (3 + 2 * len(SAMPLED_COPY_KINDS)))
            err[0] += 1
            # with the syncs off, the result copy ends each step: a step that made
            # none, or several, would not be told whole (its launches all missed)
            err[1] += (abs(guess.launches - step.launches) if step.copy_calls[D2H] == 1
                       else step.launches)
            err[2] += step.launches
            for i, ((_, want), (_, got)) in enumerate(zip(guess.copies, ref.copies)):
                err[3 + 2 * i] += abs(want - got)
                err[4 + 2 * i] += got
        self._learn_memsets(key, blind_shape, step)
        for copies_sampled, refs in self.refs.items():
            shapes = refs.setdefault(key, {})
            shape, size = step.shape(copies_sampled), _copy_sizes(step, copies_sampled)
            sizes = shapes.pop(shape, {})
            shapes[shape] = sizes
            sizes.pop(size, None)
            sizes[size] = ref
            if len(sizes) > MAX_SIZES:
                del sizes[next(iter(sizes))]
            if len(shapes) > MAX_SHAPES:
                del shapes[next(iter(shapes))]
        return idle

    def _gap(self, step: Step, prev_end: int) -> tuple[int, bool]:
        """The gap ``step``'s reference keeps: its own (previous step's end to its
        first launch), or where that looks like idle (``IDLE_GAP_FACTOR``) the thread's
        median gap (with too few gaps yet, the step's span); and whether it did."""
        gap = max(0, step.first_ts - prev_end)
        gaps = self._gaps.setdefault((step.pid, step.tid), deque(maxlen=GAP_HISTORY))
        if len(gaps) >= GAP_MIN_HISTORY:
            typical = int(median(gaps))
            if gap > max(IDLE_GAP_FACTOR * typical, step.span_ns):
                return typical, True
        elif gap > step.span_ns:
            return step.span_ns, True
        gaps.append(gap)
        return gap, False

    def _learn_memsets(self, key: ThreadKey, shape: tuple[int, ...], step: Step) -> None:
        """How far the step's memset bytes are from what its shape (without the sampled
        copies) and copy sizes made on average (``_memset_mean``)."""
        if len(self._memset_means) > MAX_MEMSET_SHAPES:
            self._memset_means.clear()
        calls, nbytes = step.memsets()
        mean = self._memset_mean(step)
        if mean is not None:
            m = self.blind_memsets.setdefault(key, [0.0, 0.0, 0.0])
            off = mean[1] / mean[0] - nbytes
            m[0] += abs(off)
            m[1] += nbytes
            m[2] += nbytes + sum(_copy_sizes(step, False))
            done = self.blind_memset_runs.setdefault(key, [[0.0, 0.0] for _ in RUN_LENGTHS])
            runs = self._memset_runs.setdefault(key, [[0, 0.0, 0.0] for _ in RUN_LENGTHS])
            for n, run, whole in zip(RUN_LENGTHS, runs, done):
                run[0] += 1
                run[1] += off
                run[2] += nbytes
                if run[0] == n:
                    whole[0] += abs(run[1])
                    whole[1] += run[2]
                    run[:] = [0, 0.0, 0.0]
        for k in ((key, shape), (key, shape, _copy_sizes(step, True))):
            mean = self._memset_means.setdefault(k, [0, 0, 0])
            mean[0] += 1
            mean[1] += nbytes
            mean[2] += calls

    def _memset_mean(self, step: Step) -> list[int] | None:
        """[steps, memset bytes, calls] of the steps counted whole of ``step``'s shape
        (without the sampled copies) and copy sizes (of the copies still probed), else
        of its shape; None if none. HF serve CB makes memsets in the steps whose
        batch is of some sizes only (7 to 16 requests on its H100 captures), which its
        result copy's bytes tell."""
        key, shape = (step.pid, step.tid), step.shape(True)
        for k in ((key, shape, _copy_sizes(step, True)), (key, shape)):
            mean = self._memset_means.get(k)
            if mean and mean[0]:
                return mean
        return None

    def _memsets_of(self, step: Step, ref: StepReference) -> tuple[int, int]:
        """The memsets a step not seen whole is given: the mean of its shape's steps
        counted whole (of its copy sizes where seen), else its reference's."""
        mean = self._memset_mean(step)
        if mean is None:
            return ref.memsets
        return round(mean[2] / mean[0]), round(mean[1] / mean[0])

    def knows(self, pid: int, tid: int) -> bool:
        """Whether a step of this thread has been seen whole (estimates can be made)."""
        return bool(self.refs[False].get((pid, tid)))

    def copies_tell_steps_apart(self, pid: int, tid: int) -> bool | None:
        """Whether this thread's steps need the copies sampled with the launches to be
        told apart (None: too few steps counted whole to say)."""
        err = self.blind.get((pid, tid))
        if err is None or err[0] < BLIND_MIN_STEPS:
            return None
        return (err[1] > BLIND_ERROR * max(1, err[2])
                or any(e > BLIND_COPY_ERROR * max(1, b) for e, b in _kind_errors(err)))

    def memsets_tell_steps_apart(self, pid: int, tid: int,
                                 request_steps: float | None = None) -> bool | None:
        """Whether this thread's memsets must stay probed: the steps counted whole
        made memset bytes off their shape's mean by more than ``BLIND_MEMSET_ERROR``
        of their memset bytes, one by one and in runs as long as a request's
        ``request_steps`` (``memset_runs_error``), and by more than
        ``BLIND_MEMSET_MOVED`` of all the bytes they moved, in all (None: too few
        steps counted whole to say)."""
        err, m = self.blind.get((pid, tid)), self.blind_memsets.get((pid, tid))
        if err is None or m is None or err[0] < BLIND_MIN_STEPS:
            return None
        runs = self.memset_runs_error(pid, tid, request_steps)
        return (m[0] > BLIND_MEMSET_ERROR * max(1, m[1])
                and m[0] > BLIND_MEMSET_MOVED * max(1, m[2])
                and (runs is None or runs[1] > BLIND_MEMSET_ERROR))

    def memset_runs_error(self, pid: int, tid: int, request_steps: float | None
                          ) -> tuple[int, float] | None:
        """The longest of ``RUN_LENGTHS`` within ``request_steps`` of which the thread
        has a whole run of steps counted whole, and how far the memset bytes of those
        runs were off their shape means summed, as a share of theirs; None where
        requests are in fewer steps, or no such run was whole yet."""
        done = self.blind_memset_runs.get((pid, tid)) or []
        for n, (off, nbytes) in reversed(list(zip(RUN_LENGTHS, done))):
            if request_steps and n <= request_steps and nbytes:
                return n, off / nbytes
        return None

    def blind_memset_error(self, pid: int, tid: int) -> float | None:
        """The share by which steps' memset bytes were off their shape's mean."""
        m = self.blind_memsets.get((pid, tid))
        return m[0] / m[1] if m and m[1] else None

    def blind_memset_shares(self, pid: int, tid: int, request_steps: float | None = None
                            ) -> tuple[float, float, tuple[int, float] | None] | None:
        """How far the steps counted whole made memset bytes off their shape's mean, as
        shares of their memset bytes and of all the bytes they moved, and in runs as
        long as a request's (``memset_runs_error``): what ``memsets_tell_steps_apart``
        weighs against ``BLIND_MEMSET_ERROR`` and ``BLIND_MEMSET_MOVED``; None before
        any step was compared."""
        m = self.blind_memsets.get((pid, tid))
        if not m or not m[2]:
            return None
        return (m[0] / max(1.0, m[1]), m[0] / m[2],
                self.memset_runs_error(pid, tid, request_steps))

    def blind_error(self, pid: int, tid: int) -> float | None:
        """The share by which launches estimated without the sampled copies were off."""
        err = self.blind.get((pid, tid))
        return err[1] / err[2] if err and err[2] else None

    def blind_copy_error(self, pid: int, tid: int) -> float | None:
        """The share by which the sampled copies' bytes estimated so were off (the
        worst kind's)."""
        err = self.blind.get((pid, tid))
        shares = [e / b for e, b in _kind_errors(err) if b] if err else []
        return max(shares) if shares else None

    def fill(self, step: Step, prev_end: int | None, copies_sampled: bool = False,
             memsets_sampled: bool = False) -> bool:
        """Give ``step`` (not counted whole) its reference's launches and kernels (and,
        where ``copies_sampled``, its SAMPLED_COPY_KINDS copies, and where
        ``memsets_sampled`` its memsets) and an estimated start;
        False (left as seen) when its thread has no reference."""
        shapes = self.refs[copies_sampled].get((step.pid, step.tid))
        if not shapes:
            return False
        ref = _reference(shapes, step.shape(copies_sampled), _copy_sizes(step, copies_sampled))
        step.estimated = True
        step.kernels = Counter(ref.kernels)
        step._mix = None
        step.work["kernel_launches"] = ref.launches
        step.work["graph_launches"] = ref.graph_launches
        if copies_sampled:
            step.set_sampled_copies(ref.copies)
            step.set_syncs(ref.syncs)
            step.copies_estimated = True
        if memsets_sampled:
            step.set_memsets(self._memsets_of(step, ref))
            step.memsets_estimated = True
        if (ref.launches or ref.graph_launches) and prev_end is not None:
            floor = (step.end_ts - FIRST_BURST_SLACK * ref.span_ns if copies_sampled
                     else step.first_end_ts - FIRST_BURST_SLACK * ref.first_burst_ns)
            step.first_ts = min(max(prev_end + ref.gap_ns, floor), step.first_end_ts)
        step.work["gpu_time_ns"] = step.span_ns  # bursts' spans for a step that launched none
        return True


def _kind_errors(err: list[int]) -> list[tuple[int, int]]:
    """A ``StepEstimates.blind`` row's (bytes error, bytes counted) per sampled kind."""
    return [(err[i], err[i + 1]) for i in range(3, len(err), 2)]


def _reference(shapes: Shapes, shape: tuple[int, ...], size: tuple[int, ...]) -> StepReference:
    """Of ``shape`` (else the nearest shape), the reference nearest in copy sizes."""
    sizes = shapes.get(shape) or shapes[_nearest(shapes, shape)]
    return sizes[_nearest(sizes, size)]


def _copy_sizes(step: Step, copies_sampled: bool) -> tuple[int, ...]:
    """The bytes ``step``'s copies moved, by kind (those probed all the time where
    ``copies_sampled``)."""
    kinds = SHAPE_COPY_KINDS if copies_sampled else COPY_KINDS
    return tuple(int(step.work.get(f"memcpy_bytes.{k}", 0)) for k in kinds)


def _nearest(keys: dict[tuple[int, ...], object], want: tuple[int, ...]) -> tuple[int, ...]:
    """The key that differs least from ``want`` (summed differences); among equals the
    latest."""
    best, best_d = None, None
    for key in reversed(keys):
        d = sum(abs(a - b) for a, b in zip(key, want))
        if best_d is None or d < best_d:
            best, best_d = key, d
    assert best is not None
    return best
