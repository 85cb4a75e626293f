"""--gpu-sample's launch estimate (tracer/correlate/sampling.py) through the GPU ledger,
on burst streams shaped like the ones that defeated the time-share estimate on a real
H200: the target runs slower while the launch probes are on."""

from __future__ import annotations

import random

from tracer.correlate.gpu import GpuLedger
from tracer.correlate.sampling import MIN_SAMPLED_STEPS, LaunchSampling, StepSample
from tracer.events.gpu import GpuSampling, KernelBurst

MS = 1_000_000
PID, TID = 100, 101


def burst(first: int, last: int, launches: int, reason: str = "sync",
          handles: dict[int, int] | None = None) -> KernelBurst:
    return KernelBurst(pid=PID, tid=TID, reason=reason, sync_api=0, first_ts=first,
                       last_ts=last, launches=launches, graph_launches=0,
                       copy_bytes={}, copy_calls={}, memset_bytes=0, memset_calls=0,
                       sync_calls=1 if reason == "sync" else 0, sync_wait_ns=0,
                       query_polls=0, handle_counts=handles or ({7: launches} if launches else {}))


def decode_loop(period_ms: int, on_ms: int, seconds: float, per_step: int,
                step_ms_on: float, step_ms_off: float, seed: int = 1):
    """Events of a loop of ``per_step`` launches then a sync, with the launch probes on
    for ``on_ms`` of each ``period_ms``; a step takes ``step_ms_on`` while they are on
    and ``step_ms_off`` otherwise. Returns (events in arrival order, true launches)."""
    rng = random.Random(seed)
    events: list = []
    t = 0
    end = int(seconds * 1000 * MS)
    switches = []
    s = 0
    while s < end:
        switches += [(s, True), (s + on_ms * MS, False)]
        s += period_ms * MS
    truth = 0
    pending = sorted(switches)
    while t < end:
        on = any(a <= t < a + on_ms * MS for a, st in switches if st)
        dur = int((step_ms_on if on else step_ms_off) * MS * rng.uniform(0.8, 1.2))
        a, b = t + 1, t + dur
        while pending and pending[0][0] <= b:
            ts, st = pending.pop(0)
            events.append(GpuSampling(ts=ts, enabled=st, fraction=on_ms / period_ms))
        # launches happen evenly in [a, b): those while the gate is open are seen
        seen = sum(1 for i in range(per_step)
                   if _open(switches, a + (b - a) * i // per_step))
        truth += per_step
        events.append(burst(a, b, seen))
        t = b
    return events, truth


def _open(switches, ts):
    state = False
    for s, st in switches:
        if s > ts:
            break
        state = st
    return state


def estimate_of(events) -> dict:
    ledger = GpuLedger()
    for ev in events:
        ledger.handle(ev)
    (proc,) = ledger.summary()["processes"]
    return proc


def test_steps_estimate_is_exact_where_the_target_slows_while_sampled():
    """Steps take 10x longer while the probes are on (the H200 failure's shape): the
    time share would be ~90 % low; launches per sampled step x steps is exact."""
    events, truth = decode_loop(period_ms=500, on_ms=100, seconds=10, per_step=50,
                                step_ms_on=6.0, step_ms_off=0.6)
    proc = estimate_of(events)
    est = proc["threads"][str(TID)]["launch_estimate"]
    assert est["method"] == "steps" and est["sampled_steps"] >= MIN_SAMPLED_STEPS
    assert proc["kernel_launches"] == truth
    assert proc["kernel_launches_seen"] < 0.35 * truth
    ledger = GpuLedger()
    for ev in events:
        ledger.handle(ev)
    t = ledger.processes[PID].threads[TID]
    time_share = t.kernel_launches / ledger.sampling.on_share(t.first_ts, t.last_ts)
    assert time_share < 0.5 * truth  # what the old estimate gave: badly low


def test_steps_estimate_with_varying_step_sizes_is_close():
    """Steps of 20-80 launches at random, probes on 20 % of the time: within 5 %."""
    rng = random.Random(3)
    events, _ = decode_loop(period_ms=1000, on_ms=200, seconds=20, per_step=1,
                            step_ms_on=1.0, step_ms_off=1.0)
    truth = 0
    switches = [(e.ts, e.enabled) for e in events if isinstance(e, GpuSampling)]
    out = []
    for ev in events:
        if isinstance(ev, KernelBurst):
            n = rng.randint(20, 80)
            truth += n
            seen = sum(1 for i in range(n)
                       if _open(switches, ev.first_ts + (ev.last_ts - ev.first_ts) * i // n))
            ev = burst(ev.first_ts, ev.last_ts, seen)
        out.append(ev)
    proc = estimate_of(out)
    assert abs(proc["kernel_launches"] - truth) < 0.05 * truth


def test_a_step_straddling_a_switch_is_not_a_sample():
    s = LaunchSampling(0.5)
    s.switch(10, True)
    s.switch(20, False)
    s.switch(30, True)
    assert s.wholly_on(11, 19)
    assert not s.wholly_on(5, 15)  # started before the probes were on
    assert not s.wholly_on(15, 25)  # they went off inside it
    assert not s.wholly_on(21, 29)
    assert s.wholly_on(31, 10**9)
    sample = StepSample()
    sample.add("interval", 12, 14, 5, 0, s)  # an interval flush does not end a step
    sample.add("sync", 15, 19, 5, 0, s)
    assert (sample.steps, sample.sampled_steps, sample.sampled_launches) == (1, 1, 10)
    sample.add("sync", 26, 35, 3, 0, s)  # began at 19 (the last step's end): off between
    assert (sample.steps, sample.sampled_steps) == (2, 1)


def test_a_thread_that_never_syncs_falls_back_to_the_time_share():
    events = [GpuSampling(ts=0, enabled=True, fraction=0.5),
              burst(1, 10 * MS, 100, reason="interval"),
              GpuSampling(ts=10 * MS, enabled=False, fraction=0.5),
              burst(10 * MS + 1, 20 * MS, 0, reason="interval"),
              GpuSampling(ts=20 * MS, enabled=True, fraction=0.5),
              burst(20 * MS + 1, 30 * MS, 100, reason="interval")]
    proc = estimate_of(events)
    assert proc["threads"][str(TID)]["launch_estimate"]["method"] == "time_share"
    assert abs(proc["kernel_launches"] - 300) <= 2


def test_switch_costs_are_summarised():
    ledger = GpuLedger()
    ledger.handle(GpuSampling(ts=0, enabled=True, fraction=0.1, attach_s=0.004))
    ledger.handle(GpuSampling(ts=MS, enabled=False, fraction=0.1))
    ledger.handle(GpuSampling(ts=9 * MS, enabled=True, fraction=0.1, attach_s=0.006,
                              detach_s=0.8))
    s = ledger.summary()["launch_sampling"]
    assert s["switches"] == 3 and s["attach_ms"] == {"mean": 5.0, "max": 6.0}
    assert s["detach_ms"] == {"mean": 800.0, "max": 800.0}
