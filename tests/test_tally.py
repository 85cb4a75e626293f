"""Decoding members' runs of steps (tracer/correlate/tally.py): charged exactly what a
part per member per step would be, across gaps and folds made mid-run."""

from __future__ import annotations

import random
from collections import Counter

from tracer.correlate.attribution import GpuShare
from tracer.correlate.steps import Step
from tracer.correlate.tally import Run, Tally
from tracer.correlate.work import Work


def step(i: int, rng: random.Random) -> Step:
    s = Step(pid=7, tid=7, index=i, bursts=rng.randint(1, 3),
             work=Work(kernel_launches=float(rng.randint(50, 300)),
                       gpu_time_ns=float(rng.randint(10**5, 10**7)),
                       sync_wait_ns=float(rng.randint(0, 10**5))),
             kernels=Counter({0x10: rng.randint(1, 9), 0x20 + rng.randint(0, 3): 5}))
    s.kernels[0x10] += int(s.work["kernel_launches"]) - sum(s.kernels.values())
    s.estimated = rng.random() < 0.2
    return s


def test_a_members_runs_are_charged_what_its_parts_would_be_across_gaps_and_early_folds():
    rng = random.Random(11)
    for _ in range(20):
        tally = Tally()
        by_runs, by_parts = GpuShare(), GpuShare()
        for i in range(rng.randint(5, 60)):
            st = step(i, rng)
            fk, ft = rng.random(), rng.random()
            rank = 0 if rng.random() < 0.8 else 1
            before = tally.sums
            after = tally.add(st, fk, ft, rank)
            if rng.random() < 0.7:  # a member of this step (else: a gap)
                run = by_runs.runs.get((7, 7))
                if run is not None and run.end is before:
                    run.end = after
                else:
                    if run is not None:
                        by_runs.ended.append(run)
                    by_runs.runs[(7, 7)] = Run(before, after)
                by_parts.add_part(st, fk, ft, False, False, "step_model", rank)
            if rng.random() < 0.1:  # read mid-run (a same-thread burst folds first)
                by_runs.fold()
        by_runs.fold()
        by_parts.fold()
        assert by_runs.steps == by_parts.steps
        assert by_runs.steps_estimated == by_parts.steps_estimated
        assert by_runs.bursts == by_parts.bursts
        assert abs(by_runs.decode_launches - by_parts.decode_launches) < 1e-6
        assert set(by_runs.work) == set(by_parts.work)
        for q, v in by_parts.work.items():
            assert abs(by_runs.work[q] - v) <= 1e-9 * max(1.0, v), q
        assert set(by_runs.kernels) == set(by_parts.kernels)
        for k, v in by_parts.kernels.items():
            assert abs(by_runs.kernels[k] - v) <= 1e-9 * max(1.0, v), k


def test_a_run_folded_twice_is_charged_once():
    rng = random.Random(3)
    tally, share = Tally(), GpuShare()
    a = tally.sums
    st = step(0, rng)
    b = tally.add(st, 0.5, 0.25, 0)
    share.runs[(7, 7)] = Run(a, b)
    share.fold()
    share.fold()
    assert share.steps == 1 and share.work["kernel_launches"] == 0.5 * st.work["kernel_launches"]
    assert share.work["gpu_time_ns"] == 0.25 * st.work["gpu_time_ns"]
