"""``--gpu-sample auto`` (the default of ``tokentrace run``): count every kernel launch
until a process launches often enough for the probes to cost it, on threads whose
launches sampling estimates well, then sample them.

Why these numbers (docs/overhead.md, "the default"):

- Every launch is a uprobe trap on the thread that launched it, the thread that holds
  the GIL in a Python server: ~0.5-1.1 us each on an H100/H200 host. HF serve
  ``--continuous-batching`` on an H200 made ~27k launches/s: full tracing added 0.038
  cores of system CPU to its one busy core and cost ~7% of its tokens/s;
  ``--gpu-sample 0.1`` added 0.020 (``bench/results/real_server-hf-cb-h200-*.json``).
  Below ``MIN_RATE`` launches a second every launch costs the server under ~0.5% of a
  core, and is counted.
- Sampling is estimated per engine step: a step the launch probes did not see whole
  takes the launches and kernels of a step of its shape they did. On a 45-s H200
  capture of HF serve CB, at 0.1 of each second, each request's launches were within
  0.08% (median), 0.27% (p90), its GPU time within 0.53% / 1.49%
  (``bench/sampling_error.py``); live under this policy, 1,152 requests at
  concurrency 32 scored against the profiler: kernel-share error 1.1% (0.9% with every
  launch counted), GPU-time share 3.6% (1.6%) (``bench/accuracy.py --gpu-sample auto``).
- The host-to-device and device-to-device copies (HF serve CB: ~7 and ~38 a step, over
  half of the traps left once launches are sampled) and the syncs (nine a step) are
  switched with the launch probes too where the other probes tell the deciding
  threads' steps apart as well without them: launches estimated without them over the
  steps counted so far were off by 3% or less (a step that did not make exactly one
  device-to-host copy, which then ends it, counted as all missed), and each kind's
  bytes by 10% or less (``StepEstimates.copies_tell_steps_apart``; HF serve CB ~1% and
  2-4%, HF generate 29%: its steps of 143, 5 and 2 launches differ only in these
  copies). Else they stay probed.
- The memsets are switched on their own, where every deciding thread's steps counted
  so far made the memset bytes their shape makes on average, to within 10% of those
  bytes a step, or over runs of as many steps as a request is in, or to within 1% of
  all the bytes the steps moved (``StepEstimates.memsets_tell_steps_apart``): HF serve CB's H100
  captures make them in a few steps (~100% off, but 0.1-0.3% of the bytes moved:
  switched); on an exact c8 capture on H200s they are 14% of the bytes, a step's 15.7%
  off but 2.3% over runs of 64 steps, as its requests' (each request's memset bytes
  1.3% off at the median, 5% at p90: switched).
- A thread that serves its one request itself (a burst charged whole to it,
  "same-thread") has no steps: sampled, its launches would only be scaled by the share
  of time the probes were on, once 90% low on a real GPU. So sampling is chosen only
  while every thread that launches is an engine's step thread, and given up for good
  (back to exact counting) when a same-thread launcher shows up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Mapping

# SAMPLED_COPY_KINDS and the syncs, in words
COPIES = "host-to-device and device-to-device copies and syncs"
# the share of each --gpu-sample-period the launch probes are on. 0.05 halved the traps
# of 0.1 (HF serve CB on an H100 at c32, against the profiler: kernel share 0.0088 and
# GPU-time share 0.038 MAE/mean at 0.05, 0.0101 and 0.0245 at 0.1;
# bench/results/accuracy-hf-cb-h100-auto-{f005,sessions}.json). 0.03 estimates about
# as well as 0.05 on the H100 captures (16 phases each, with the syncs and memsets
# switched: launches in all 0.9856-1.0031 against 0.9784-1.0025, worst-phase median
# per-request launch error 0.36%/0.70% against 0.50%/0.58%;
# bench/results/sampling_error-h100-cb-f*-syncs-16.json), and 0.025 or 0.02 less
# well (medians 0.7-1.1%; docs/overhead.md, "a smaller launch fraction, measured
# again"). Live on H100s at c32: kernel share 0.0095-0.0101 MAE/mean, HF serve CB's
# tokens/s 0.979 (0.957-1.000) of untraced (docs/overhead.md, "0.03 with the syncs
# switched, measured on H100s")
FRACTION = 0.03
# Where steps are short, a smaller window still holds whole steps: 0.02 of each period
# where its window spans at least MIN_WINDOW_STEPS of the deciding threads' steps (the
# mean interval, end to end, of each one's latest steps: StepTotals.interval_ns; idle
# gaps lengthen it, as a window must span them too). On the exact c8 capture of HF serve CB on
# an H200 (8.5-ms steps: 20-ms windows span 2.35 of them), 0.02 estimated as well as 0.03
# over 16 phases (launches in all 0.991-1.001 against 0.991-1.003, median per-request
# launch error 0.35-0.49% against 0.36-0.46%), and nearly so on the H100 fixture (9.6-ms
# steps, 2.08 of them: 0.980-1.000 against 0.986-0.999, 0.24-1.04% against 0.14-0.70%);
# 0.015 on c8 (1.76 steps) left one phase 6.9% short, and on the H100 c32 capture
# (17.3-ms steps) 0.02 (1.16 steps) tripled the median error
# (bench/results/sampling_error-h200-cb-c8-f00{3,2,15}-memsets-16.json,
# sampling_error-h100-cb-f00{3,2}-syncs-16.json). Every check while sampling looks
# again (a quarter step of hysteresis). Each launch trap costs a server
# ~7 us of CPU, and the windows' launches are ~1 trap per token on the bench's load:
# a third of them fewer (docs/overhead.md, "a smaller window where steps are short")
SHORT_FRACTION = 0.02
MIN_WINDOW_STEPS = 2.0
HYSTERESIS_STEPS = 0.25
MIN_RATE = 5000.0  # launches per second, over one check, before sampling pays
CHECK_S = 5.0  # how often the launch rate and the launching threads are looked at
MIN_STEPS = 20  # steps a launching thread closed in one check: it is a step engine
MINOR_SHARE = 0.01  # a thread with less of the check's launches does not decide

ThreadKey = tuple[int, int]  # (pid, tid)
# a thread's memset bytes off their estimate: shares of its memset bytes a step, of all
# the bytes its steps moved, and (run length, share) over runs of a request's steps
MemsetShares = tuple[float, float, "tuple[int, float] | None"]


@dataclass
class AutoSample:
    """The policy, fed what the analysis knows at each check; it says when to switch.

    ``check`` gets, per launching thread, its launches seen and steps closed so far
    (cumulative), the threads whose bursts were charged whole to one request, and per
    thread whether its steps need the sampled copies (SAMPLED_COPY_KINDS) to be told apart (None:
    not known yet) and whether its memsets must stay probed; it returns the
    ``--gpu-sample`` fraction to switch to, or None, and leaves in ``copies`` and
    ``memsets`` whether those are to be switched with the launches."""

    fraction: float = FRACTION  # of a base period where steps are long; once sampling,
    # the share of the period in force
    short_fraction: float = SHORT_FRACTION  # of a base period, where its window spans enough steps
    min_window_steps: float = MIN_WINDOW_STEPS
    min_rate: float = MIN_RATE
    min_steps: int = MIN_STEPS
    check_s: float = CHECK_S  # the caller checks this often
    state: str = "exact"  # "exact", "sampling", or "off" (held exact for good)
    reason: str = "launches counted until they are frequent on step engines"
    copies: bool = False  # the sampled copies switched with the launches
    memsets: bool = False  # and the memsets
    _last: dict[ThreadKey, tuple[int, int]] = field(default_factory=dict)
    _last_ts: float | None = None
    _long: float = 0.0  # the fraction for long steps (``fraction`` as constructed)
    _window_s: float = 0.0  # the window in force while sampling, seconds
    _step_s: float = 0.0  # the longest deciding step at the last choice
    _base_s: float = 1.0  # the period the fractions are shares of
    _why: tuple[str, str] = ("", "")  # the reason's words before and after the fraction

    def __post_init__(self) -> None:
        self._long = self.fraction

    def hand_set(self) -> None:
        """The user set ``gpu-sample`` themselves: the policy stands down."""
        self.state, self.reason = "off", "set by hand (control gpu-sample)"

    def restart(self) -> None:
        """Forget the last check (after a pause: its span is no measure of a rate)."""
        self._last_ts = None

    def check(self, now: float, threads: Mapping[ThreadKey, tuple[int, int]],
              same_thread: AbstractSet[ThreadKey],
              copies_needed: Mapping[ThreadKey, bool | None] | None = None,
              memsets_needed: Mapping[ThreadKey, bool | None] | None = None,
              memset_errors: Mapping[ThreadKey, MemsetShares | None] | None = None,
              period_s: float = 1.0,
              step_ns: Mapping[ThreadKey, int | None] | None = None,
              base_period_s: float | None = None) -> float | None:
        """The fraction to switch to now, or None to stay as it is. ``memset_errors``:
        per thread, how far its memset bytes were off their estimate, as shares of its
        memset bytes and of all the bytes its steps moved, and over runs of a request's
        steps (``StepEstimates.blind_memset_shares``, for ``reason``). ``period_s``: the
        sampling period in force, ``base_period_s`` the one the fractions are shares of
        (the agent's default period; ``period_s`` where not given): the windows keep
        their length in seconds, so a longer period opens the same window less often
        (``fraction`` is then window / ``period_s``). The short window must span
        ``min_window_steps`` of the deciding threads' steps to be chosen, at the switch
        and at every check after it (the steps are closed whether sampled or not). A step is
        ``step_ns``, per thread (the mean interval of its latest steps, end to end:
        ``StepTotals.interval_ns``), else the check's span over the steps it closed."""
        last, last_ts = self._last, self._last_ts
        self._last, self._last_ts = dict(threads), now
        self._base_s = base_period_s or period_s
        if self.state == "off" or last_ts is None or now <= last_ts:
            return None
        span = now - last_ts
        new = {k: (n - last.get(k, (0, 0))[0], s - last.get(k, (0, 0))[1])
               for k, (n, s) in threads.items()}
        launching = {k for k, (n, _) in new.items() if n > 0}
        alone = sorted(launching & same_thread)
        if alone:
            was = self.state
            self.state = "off"
            self.reason = (f"thread {alone[0][1]} of process {alone[0][0]} launches for "
                           "the one request it serves: every launch counted")
            return 1.0 if was == "sampling" else None
        total = sum(n for n, _ in new.values())
        deciding = [k for k in launching if new[k][0] >= MINOR_SHARE * total]
        intervals = step_ns or {}

        def step_s() -> float:
            """The longest step of a deciding thread: its steps' own interval where
            known, else the check's span over the steps it closed."""
            return max(intervals[k] / 1e9 if intervals.get(k) else span / max(1, new[k][1])
                       for k in deciding)

        if self.state == "sampling":
            if not deciding or any(new[k][1] < self.min_steps for k in deciding):
                return None  # too few steps to judge by: as it is
            was = self.fraction
            self._choose(step_s(), period_s)
            return self.fraction if self.fraction != was else None
        per_process: dict[int, int] = {}
        for (pid, _), (n, _) in new.items():
            per_process[pid] = per_process.get(pid, 0) + n
        # the traps land on each process's own threads: its rate is what it pays
        rate = max(per_process.values(), default=0) / span
        if rate < self.min_rate:
            return None
        if any(new[k][1] < self.min_steps for k in deciding):
            return None  # a busy launcher that does not close steps (yet): no estimate
        self.state = "sampling"
        needed = [(copies_needed or {}).get(k) for k in deciding]
        self.copies = bool(needed) and all(n is False for n in needed)
        memsets = [(memsets_needed or {}).get(k) for k in deciding]
        self.memsets = bool(memsets) and all(n is False for n in memsets)
        self._why = (f"{rate:,.0f} launches/s in one process, on {len(deciding)} engine "
                     "step thread(s) in all",
                     (f", with the {COPIES}" if self.copies else
                      f"; {COPIES} all counted (they tell steps apart)" if any(needed) else
                      f"; {COPIES} all counted (too few steps to tell whether they are "
                      "needed)")
                     + (", and the memsets" if self.memsets else "; memsets all counted")
                     + _why_memsets(deciding, memsets, memset_errors or {}, self.memsets))
        self._choose(step_s(), period_s)
        return self.fraction

    def set_period(self, period_s: float) -> float | None:
        """The sampling period was changed while running (``--control sample-period``):
        the share that keeps the window in force, or None if sampling is not on (the
        next check chooses with the new period) or it is the same share."""
        if self.state != "sampling" or not self._window_s:
            return None
        was = self.fraction
        self._choose(self._step_s, period_s)
        return self.fraction if self.fraction != was else None

    def _choose(self, step_s: float, period_s: float) -> None:
        """``fraction`` and ``reason`` for a longest step of ``step_s``: the short
        window where it spans ``min_window_steps`` of them. A step's interval
        holds the idle gap before it, which a window must span too to count it whole:
        an engine with gaps gets the larger window."""
        long_s, short_s = self._long * self._base_s, self.short_fraction * self._base_s
        # a quarter step of hysteresis once short: a load at the edge does not flip it
        # every check
        need = self.min_window_steps - (HYSTERESIS_STEPS if self._window_s and
                                        self._window_s < long_s else 0)
        short = short_s < long_s and short_s >= need * step_s
        self._window_s, self._step_s = (short_s if short else long_s), step_s
        self.fraction = min(1.0, self._window_s / period_s)
        self.reason = (f"{self._why[0]}, a step every {step_s * 1e3:.1f} ms: launch probes "
                       f"on {self.fraction:g} of each period"
                       + (f" ({self._window_s * 1e3:.0f}-ms windows every {period_s:g} s"
                          + (f", spanning {self._window_s / step_s:.1f} steps" if short else "")
                          + ")" if short or period_s != self._base_s else "")
                       + self._why[1])


def _why_memsets(deciding: list[ThreadKey], needed: list[bool | None],
                 errors: Mapping[ThreadKey, MemsetShares | None], switched: bool) -> str:
    """Why the memsets are ``switched`` or stay probed, in words: the deciding thread
    whose estimate was worst against all the bytes its steps moved (of those that keep
    them probed, if any do), else that some could not be judged."""
    shares = [(e[1], e[0], e[2], k) for k, n in zip(deciding, needed)
              if (n or switched) and (e := errors.get(k)) is not None]
    if shares:
        moved, own, runs, k = max(shares, key=lambda x: x[:2])
        over_runs = (f", {runs[1]:.0%} over runs of {runs[0]} steps, as a request's"
                     if runs is not None else "")
        return (f" (thread {k[1]}: its memset bytes estimated off by {own:.0%} of them "
                f"a step{over_runs}, {moved:.2%} of all the bytes its steps moved)")
    if not switched and (any(n is None for n in needed) or not needed):
        return " (too few steps counted whole to tell)"
    return ""
