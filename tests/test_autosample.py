"""``--gpu-sample auto``: the policy on its own, then on the analysis of real GPU
captures (HF serve on an H100, every launch counted), checked as the agent checks it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.sampling_error import load
from tracer.autosample import AutoSample
from tracer.correlate.connections import TrackerOptions
from tracer.events import capture
from tracer.pipeline import Pipeline

CAPTURES = Path(__file__).resolve().parents[1] / "samples/captures"
ENGINE, OTHER = (1, 10), (1, 11)


def test_counts_every_launch_until_launches_are_frequent():
    auto = AutoSample(min_rate=1000, min_steps=20)
    assert auto.check(0.0, {ENGINE: (0, 0)}, set()) is None  # the first check: a baseline
    assert auto.check(5.0, {ENGINE: (4000, 100)}, set()) is None  # 800/s
    assert auto.state == "exact"
    assert auto.check(10.0, {ENGINE: (14000, 200)}, set()) == auto.fraction  # 2,000/s
    assert auto.state == "sampling"
    assert "engine step thread" in auto.reason
    assert auto.check(15.0, {ENGINE: (15000, 300)}, set()) is None  # stays sampling


def test_the_rate_is_a_process_s_own():
    auto = AutoSample(min_rate=1000, min_steps=20)
    auto.check(0.0, {}, set())
    # eight processes at 800 launches/s each: each pays for its own
    eight = {(pid, 10): (4000, 100) for pid in range(1, 9)}
    assert auto.check(5.0, eight, set()) is None
    eight[(1, 10)] = (4000 + 6000, 200)  # one of them at 2,000/s from here
    assert auto.check(10.0, eight, set()) == auto.fraction


def test_a_busy_thread_that_closes_no_steps_keeps_exact_counting():
    auto = AutoSample(min_rate=1000, min_steps=20)
    auto.check(0.0, {}, set())
    # the engine steps, but the other thread launches a third of them with no step end
    assert auto.check(5.0, {ENGINE: (20000, 500), OTHER: (10000, 3)}, set()) is None
    assert auto.state == "exact"
    # a thread with under 1% of the launches does not decide
    assert auto.check(10.0, {ENGINE: (40000, 1000), OTHER: (10100, 3)}, set()) == auto.fraction


def test_a_thread_serving_its_own_request_turns_sampling_back_for_good():
    auto = AutoSample(min_rate=1000, min_steps=20)
    auto.check(0.0, {}, set())
    assert auto.check(5.0, {ENGINE: (20000, 500)}, set()) == auto.fraction
    # a launch by a thread whose burst was charged whole to its one request
    assert auto.check(10.0, {ENGINE: (30000, 900), OTHER: (5, 0)}, {OTHER}) == 1.0
    assert auto.state == "off" and "one request it serves" in auto.reason
    assert auto.check(15.0, {ENGINE: (90000, 2000), OTHER: (5, 0)}, {OTHER}) is None


def test_same_thread_launches_from_the_start_never_sample():
    auto = AutoSample(min_rate=10)
    auto.check(0.0, {}, set())
    assert auto.check(5.0, {OTHER: (50000, 0)}, {OTHER}) is None
    assert auto.state == "off"


def test_set_by_hand_stands_the_policy_down():
    auto = AutoSample(min_rate=1)
    auto.check(0.0, {}, set())
    auto.hand_set()
    assert auto.check(5.0, {ENGINE: (10**6, 10**4)}, set()) is None
    assert auto.state == "off" and "by hand" in auto.reason


def test_a_pause_is_no_measure_of_a_rate():
    auto = AutoSample(min_rate=1000)
    auto.check(0.0, {ENGINE: (0, 0)}, set())
    auto.restart()  # resumed after a pause: the next check is a baseline only
    assert auto.check(100.0, {ENGINE: (500000, 9000)}, set()) is None
    assert auto.check(105.0, {ENGINE: (510000, 9200)}, set()) == auto.fraction


def test_short_steps_get_the_smaller_window():
    """A 20-ms window (0.02 of the 1-s base period) where it spans two of the deciding
    threads' mean steps (the longest of theirs), else 30 ms; a longer period opens the
    same window less often."""
    for steps, period, fraction in ((1000, 1.0, 0.02), (500, 1.0, 0.02), (400, 1.0, 0.03),
                                    (1000, 2.0, 0.01), (400, 2.0, 0.015),
                                    (1000, 4.0, 0.005)):
        auto = AutoSample()
        auto.check(0.0, {}, set())
        assert auto.check(5.0, {ENGINE: (40000, steps)}, set(), period_s=period,
                          base_period_s=1.0) == fraction
        step_ms = 5000 / steps
        assert f"a step every {step_ms:.1f} ms: launch probes on {fraction:g} of" in auto.reason
        window_ms = 1000 * fraction * period
        assert (f"({window_ms:.0f}-ms windows every {period:g} s"
                in auto.reason) is (window_ms == 20 or period != 1.0), auto.reason
        assert (f"spanning {window_ms / step_ms:.1f} steps)" in auto.reason) is (
            window_ms == 20), auto.reason
    auto = AutoSample()  # the slower of two engine threads decides
    auto.check(0.0, {}, set())
    assert auto.check(5.0, {ENGINE: (40000, 1000), OTHER: (40000, 300)}, set()) == 0.03
    # a fraction set below the short one is never raised to it
    auto = AutoSample(fraction=0.01)
    auto.check(0.0, {}, set())
    assert auto.check(5.0, {ENGINE: (40000, 1000)}, set()) == 0.01


def test_a_new_period_keeps_the_window():
    """--control sample-period while sampling: the same window, a share of the new
    period; before sampling began, nothing to change (the next check uses it)."""
    auto = AutoSample()
    assert auto.set_period(2.0) is None
    auto.check(0.0, {}, set())
    assert auto.check(5.0, {ENGINE: (40000, 1000)}, set(), period_s=1.0) == 0.02
    assert auto.set_period(2.0) == 0.01
    assert "(20-ms windows every 2 s, spanning 4.0 steps)" in auto.reason
    assert auto.set_period(2.0) is None  # the same share: no switch
    assert auto.set_period(1.0) == 0.02
    auto.hand_set()
    assert auto.set_period(2.0) is None  # stood down: the hand-set share stays
    # a period shorter than the window's: every launch counted, still "sampling"
    auto = AutoSample()
    auto.check(0.0, {}, set())
    auto.check(5.0, {ENGINE: (40000, 1000)}, set())
    assert auto.set_period(0.01) == 1.0


def test_the_steps_own_intervals_size_the_window_when_known():
    """The check's span over its steps counts a stall, and the agent's lag in reading
    the records: the steps' own intervals (stream clock) do not."""
    auto = AutoSample()
    auto.check(0.0, {}, set())
    # 400 steps in 5 s looks like 12.5 ms a step; their intervals say 6 ms
    assert auto.check(5.0, {ENGINE: (40000, 400)}, set(), step_ns={ENGINE: 6_000_000}) == 0.02
    assert "a step every 6.0 ms" in auto.reason
    auto = AutoSample()
    auto.check(0.0, {}, set())
    # and the other way: a thread with no interval yet falls back to the span
    assert auto.check(5.0, {ENGINE: (40000, 1000), OTHER: (40000, 1000)}, set(),
                      step_ns={ENGINE: 15_000_000, OTHER: None}) == 0.03
    assert "a step every 15.0 ms" in auto.reason


def test_a_step_interval_leaves_out_the_longest_two_percent():
    from tracer.correlate.steps import Step, StepTotals

    totals = StepTotals()
    assert totals.interval_ns() is None
    end = 0
    for i in range(100):
        gap = 5_000_000_000 if i == 50 else (1_000_000 if i % 2 else 9_000_000)
        totals.book(Step(pid=1, tid=1, end_ts=end + gap), end if i else None)
        end += gap
    # 99 intervals, 2% of them (one) left out: the pause of 5 s; both kinds of step
    # kept, 50 of 1 ms and 48 of 9 ms (a median would say 1 ms)
    assert totals.interval_ns() == (50 * 1_000_000 + 48 * 9_000_000) // 98


def test_the_window_follows_the_steps_while_sampling():
    auto = AutoSample()
    auto.check(0.0, {}, set())
    seen = [40000, 1000]

    def after(steps: int, t: list[float] = [5.0]) -> float | None:
        seen[0] += 40000
        seen[1] += steps
        t[0] += 5.0
        return auto.check(t[0], {ENGINE: (seen[0], seen[1])}, set())

    assert auto.check(5.0, {ENGINE: tuple(seen)}, set()) == 0.02  # 5 ms a step
    assert after(400) == 0.03  # 12.5 ms: 20 ms spans 1.6 of them
    assert "on 0.03 of each period" in auto.reason and auto.state == "sampling"
    assert after(476) is None  # 10.5 ms, 1.9 steps: not yet
    assert after(527) == 0.02  # 9.5 ms, 2.1 steps
    assert after(476) is None  # 1.9 steps: held by the hysteresis, not flipped back
    assert after(10) is None  # too few steps to judge by: as it is
    assert auto.fraction == 0.02
    assert auto.check(40.0, {ENGINE: (seen[0] + 5, seen[1] + 400), OTHER: (5, 0)},
                      {OTHER}) == 1.0  # a same-thread launcher still ends it for good
    assert auto.state == "off"


def decide_over(path: Path, auto: AutoSample) -> tuple[list[tuple[float, float]], Pipeline]:
    """Replay a capture, asking the policy every ``check_s`` of the capture's clock as
    the agent does; the (seconds in, fraction) switches it asked for."""
    items, header = load(path)
    p = Pipeline([], options=TrackerOptions(tenant_salt=capture.tenant_salt(header)))
    switches: list[tuple[float, float]] = []
    start = next_check = None
    for item in items:
        p.feed(item)
        now = p.last_ts / 1e9
        if not now:
            continue
        if start is None:
            start = next_check = now
        if now >= next_check:
            next_check = now + auto.check_s
            threads = p.gpu_threads()
            est = p.attribution.estimates
            f = auto.check(now, threads, p.attribution.same_thread,
                           {k: est.copies_tell_steps_apart(*k) for k in threads},
                           step_ns=p.step_intervals())
            if f is not None:
                switches.append((round(now - start, 1), f))
    p.close()
    return switches, p


@pytest.mark.parametrize("name,copies", [("hf-cb-c32-h100.ttcap", True),
                                          ("hf-plain-c4-h100.ttcap", False)])
def test_hf_serve_on_an_h100_is_sampled_once_its_engine_is_busy(name, copies):
    # both launch from threads that never move a request's bytes and close a step per
    # sync: continuous batching's generation thread, plain serve's generate() thread.
    # Continuous batching's steps are told apart without their host-to-device and
    # device-to-device copies (those are sampled too); generate()'s are not (three kinds
    # of step, one shape without them: they stay probed)
    auto = AutoSample()
    switches, p = decide_over(CAPTURES / name, auto)
    assert [f for _, f in switches] == [auto.fraction], (switches, auto.reason)
    assert switches[0][0] <= 3 * auto.check_s  # within the first checks of load
    assert auto.state == "sampling"
    assert auto.copies is copies, auto.reason
    threads = p.gpu_threads()
    assert threads and not set(threads) & p.attribution.same_thread


def test_hf_serve_s_engines_get_the_window_their_steps_call_for():
    """The exact captures, checked as the agent checks, by their steps' intervals: c32
    on an H100 (17 ms) keeps 0.03 throughout; c8 on an H200 (8.5 ms), the H100 fixture
    (9.6 ms) and plain serve's generate() (2.8 ms: 0.5-0.7 and 5.5-7 ms steps) get 0.02
    at the first check and keep it."""
    expect = {"hf-cb-c32-h100.ttcap": [0.03], "hf-plain-c4-h100.ttcap": [0.02],
              "hf-cb-c8-h200.ttcap": [0.02], "hf-serve-cb-h100.ttcap": [0.02]}
    for name, fractions in expect.items():
        auto = AutoSample()
        switches, _ = decide_over(CAPTURES / name, auto)
        assert [f for _, f in switches] == fractions, (name, switches, auto.reason)


def test_the_copies_go_with_the_launches_only_where_every_deciding_thread_allows():
    for needed, copies in (({ENGINE: False}, True), ({ENGINE: True}, False),
                           ({ENGINE: None}, False), ({}, False),
                           ({ENGINE: False, OTHER: True}, False)):
        auto = AutoSample()
        auto.check(0.0, {}, set())
        launched = {ENGINE: (40000, 1000), OTHER: (40000, 1000)}
        if OTHER not in needed:
            del launched[OTHER]
        assert auto.check(5.0, launched, set(), needed) == auto.fraction
        assert auto.copies is copies, (needed, auto.reason)


def test_the_memsets_go_with_the_launches_only_where_every_deciding_thread_allows():
    """Decided on their own: a thread whose copies tell its steps apart may still let
    its memsets go (they are in no step's shape)."""
    for needed, memsets in (({ENGINE: False}, True), ({ENGINE: True}, False),
                            ({ENGINE: None}, False), ({}, False)):
        auto = AutoSample()
        auto.check(0.0, {}, set())
        assert auto.check(5.0, {ENGINE: (40000, 1000)}, set(), {ENGINE: True},
                          needed) == auto.fraction
        assert auto.memsets is memsets and not auto.copies, (needed, auto.reason)
        assert ("and the memsets" in auto.reason) is memsets, auto.reason
        assert ("too few steps" in auto.reason) is (needed.get(ENGINE, None) is None)


def test_memsets_kept_counted_say_how_far_off_their_estimate_was():
    auto = AutoSample()
    auto.check(0.0, {}, set())
    both = {ENGINE: (40000, 1000), OTHER: (40000, 1000)}
    assert auto.check(5.0, both, set(), {ENGINE: False, OTHER: False},
                      {ENGINE: True, OTHER: True},
                      {ENGINE: (0.38, 0.024, (32, 0.12)), OTHER: (0.9, 0.011, None)}
                      ) == auto.fraction
    assert not auto.memsets
    # the worst against all the bytes moved is what the policy weighed
    assert f"thread {ENGINE[1]}: its memset bytes estimated off by 38% of them a step, " \
        "12% over runs of 32 steps, as a request's, 2.40% of all the bytes" in auto.reason, \
        auto.reason
    auto = AutoSample()
    auto.check(0.0, {}, set())
    auto.check(5.0, both, set(), {ENGINE: False, OTHER: False}, {ENGINE: True, OTHER: True},
               {OTHER: (0.9, 0.011, None)})
    assert "off by 90% of them a step, 1.10% of all" in auto.reason, auto.reason


def test_the_sampling_period_follows_how_fast_the_launch_probes_detach():
    from types import SimpleNamespace

    from tracer.probes.session import CaptureConfig, CaptureSession

    s = CaptureSession(CaptureConfig(), lambda item: None)
    s.gpu = SimpleNamespace(uprobes=SimpleNamespace(multi=True))  # type: ignore[assignment]
    assert s.sample_period_s() == 1.0  # links: a detach takes ~0.1 s
    s.gpu.uprobes.multi = False
    assert s.sample_period_s() == 5.0  # perf events: ~1 s
    s.config.gpu_sample_period_s = 2.5
    assert s.sample_period_s() == 2.5


def test_memsets_switched_say_how_far_off_their_estimate_was():
    """The operator sees why auto let them go, as why it kept them: the worst error of
    the deciding threads' estimates."""
    auto = AutoSample()
    auto.check(0.0, {}, set())
    both = {ENGINE: (40000, 1000), OTHER: (40000, 1000)}
    assert auto.check(5.0, both, set(), {ENGINE: False, OTHER: False},
                      {ENGINE: False, OTHER: False},
                      {ENGINE: (0.33, 0.12, (32, 0.07)), OTHER: (0.2, 0.001, None)}
                      ) == auto.fraction
    assert auto.memsets
    assert auto.reason.endswith(
        f", and the memsets (thread {ENGINE[1]}: its memset bytes estimated off by 33% of "
        "them a step, 7% over runs of 32 steps, as a request's, 12.00% of all the bytes its "
        "steps moved)"), auto.reason
    auto = AutoSample()  # no estimate to quote: nothing invented
    auto.check(0.0, {}, set())
    auto.check(5.0, both, set(), {ENGINE: False, OTHER: False}, {ENGINE: False, OTHER: False})
    assert auto.reason.endswith(", and the memsets"), auto.reason
