"""bench/window_effect.py: the sampling windows read from a capture's switches, and each
token gap and request sorted by what the probes were doing meanwhile, on a synthetic
run whose windows slow the server by a known amount (and on one where they do not)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench import window_effect as we
from tracer.events.capture import CaptureWriter
from tracer.events.gpu import GpuSampling
from tracer.events.schema import TracingPaused

S = 1_000_000_000


def switches(start: float, n: int, period: float = 1.0, window: float = 0.03,
             attach: float = 0.02, detach: float = 0.09) -> list[object]:
    """n sampled periods from ``start`` (s): on (after an attach), off, the next on
    saying how long the detach took."""
    out: list[object] = []
    for k in range(n):
        on = start + k * period
        out.append(GpuSampling(ts=int(on * S), enabled=True, fraction=0.03,
                               attach_s=attach if k else 0.0, detach_s=detach if k else 0.0))
        out.append(GpuSampling(ts=int((on + window) * S), enabled=False, fraction=0.03))
    return out


def test_windows_from_switches_attach_before_on_detach_after_off() -> None:
    wins = we.windows_of(switches(10.0, 3))
    assert len(wins) == 3
    w = wins[1]
    assert w.on == pytest.approx(11.0) and w.off == pytest.approx(11.03)
    assert w.attach_start == pytest.approx(10.98)
    assert wins[0].detach_end == pytest.approx(10.03 + 0.09)  # said by the next "on"
    assert wins[2].detach_end == pytest.approx(12.03 + 0.09)  # the last: the median


def test_a_pause_closes_the_open_window_and_fraction_one_ends_sampling() -> None:
    evs = [GpuSampling(ts=10 * S, enabled=True, fraction=0.03),
           TracingPaused(ts=int(10.01 * S), paused=True),
           TracingPaused(ts=12 * S, paused=False),
           GpuSampling(ts=int(12.5 * S), enabled=True, fraction=0.03, attach_s=0.02),
           GpuSampling(ts=int(12.6 * S), enabled=True, fraction=1.0)]
    wins = we.windows_of(evs)
    assert [(w.on, w.off) for w in wins] == [(10.0, pytest.approx(10.01)),
                                            (12.5, pytest.approx(12.6))]


def test_classify_prefers_window_then_attach_then_detach() -> None:
    wins = we.windows_of(switches(10.0, 3))
    starts = [w.attach_start for w in wins]
    assert we.classify(10.995, 11.001, wins, starts) == "window"
    assert we.classify(10.985, 10.99, wins, starts) == "attach"
    assert we.classify(11.05, 11.06, wins, starts) == "detach"
    assert we.classify(11.3, 11.31, wins, starts) == "clear"
    assert we.classify(10.9, 11.2, wins, starts) == "window"  # spans all three


def synthetic_log(tmp: Path, slow: float) -> Path:
    """A crossover-shaped --window-log: replica 0 traced by agent-0 in "full" slices,
    its token gaps ``slow`` times longer inside agent-0's windows; replica 1 untraced
    at the same moments, never slowed."""
    start, n = 100.0, 60
    w = CaptureWriter(tmp / "agent-0.ttcap")
    for ev in switches(start, n):
        w.write(ev)
    w.close()
    CaptureWriter(tmp / "agent-1.ttcap").close()
    wins = we.windows_of(switches(start, n))
    rng = random.Random(1)
    for rep in (0, 1):
        stamps, first = [], []
        for thread in range(4):
            t, s, f = start + 0.001 * thread, [], []
            while t < start + n:
                t0, t = t, t + rng.uniform(0.015, 0.025)  # TTFT
                f.append((t0, t - t0))
                s.append(t)
                for _ in range(rng.randint(10, 30)):
                    gap = rng.uniform(0.008, 0.012)
                    if rep == 0 and any(x.on < t + gap and t < x.off for x in wins):
                        gap *= slow
                    t += gap
                    s.append(t)
            stamps.append(s)
            first.append(f)
        (tmp / f"client-{rep}.json").write_text(json.dumps({"stamps": stamps, "first": first}))
    slices = [{"replica": rep, "mode": mode, "round": k, "t0": start + 3 * k, "wall_s": 3.0}
              for k in range(n // 3) for rep, mode in ((0, "full"), (1, "untraced"))]
    (tmp / "slices.json").write_text(json.dumps(
        {"slices": slices, "agent_of_replica": {"0": "agent-0", "1": "agent-1"}}))
    return tmp


def test_a_known_slowdown_inside_the_windows_is_found_and_phantoms_hold_one(tmp_path: Path) -> None:
    doc = we.analyse(synthetic_log(tmp_path, slow=1.3))
    assert doc["windows"] == {"agent-0": 60, "agent-1": 0}
    gaps = doc["full"]["token_gaps"]
    lo, hi = gaps["window"]["effect_ci95"]
    assert 1.1 < lo and hi < 1.5, gaps["window"]
    # gaps beside the windows were not slowed: their effect holds 1
    lo, hi = gaps["detach"]["effect_ci95"]
    assert lo < 1.0 < hi
    # the untraced replica, sorted by the other half's windows: nothing
    lo, hi = doc["untraced"]["token_gaps"]["window"]["effect_ci95"]
    assert lo < 1.0 < hi


def test_no_slowdown_no_effect(tmp_path: Path) -> None:
    doc = we.analyse(synthetic_log(tmp_path, slow=1.0))
    lo, hi = doc["full"]["token_gaps"]["window"]["effect_ci95"]
    assert lo < 1.0 < hi
    assert doc["full"]["ttft"]["window"]["n"] > 0


def streams_with_a_stall(stall: tuple[float, float] | None, n: int = 8, t0: float = 0.0,
                         t1: float = 40.0) -> tuple[list[list[float]], list[list[tuple[float, float]]]]:
    """n streams of tokens every ~10 ms from t0 to t1, each a request of 20 tokens
    (its first ~20 ms after it was sent), none in ``stall``."""
    rng = random.Random(3)
    stamps, first = [], []
    for i in range(n):
        t, s, f = t0 + 0.001 * i, [], []
        while t < t1:
            sent = t
            t += rng.uniform(0.015, 0.025)
            for k in range(20):
                if stall and stall[0] <= t < stall[1]:
                    t = stall[1] + rng.uniform(0, 0.002)
                if k == 0:
                    f.append((sent, t - sent))
                s.append(t)
                t += rng.uniform(0.008, 0.012)
        stamps.append(s)
        first.append(f)
    return stamps, first


def test_a_silence_of_the_whole_server_is_a_stall_and_its_waits_are_told_apart() -> None:
    from bench.real_server import server_stalls, slice_stalls, unstalled
    stamps, first = streams_with_a_stall((20.0, 20.3))
    found, threshold = server_stalls(stamps, 18.0, 21.0)
    assert len(found) == 1 and threshold is not None and threshold < 0.3
    a, b = found[0]
    assert 19.98 < a < 20.0 and 20.3 < b < 20.31
    assert server_stalls(stamps, 22.0, 25.0)[0] == []  # ordinary gaps are not stalls
    got = slice_stalls(stamps, first, 18.0, 21.0)
    assert got["stalls"] == [[round(a - 18.0, 4), round(b - a, 4)]]
    assert got["ttft_stalled_ms"] and all(x > 250 for x in got["ttft_stalled_ms"])
    w = {"ttft_ms": [5.0, got["ttft_stalled_ms"][0], 7.0, got["ttft_stalled_ms"][0]],
         "ttft_stalled_ms": got["ttft_stalled_ms"][:1]}
    assert unstalled(w) == [5.0, 7.0, got["ttft_stalled_ms"][0]]  # one copy out per stall


def test_no_stall_without_a_silence_nor_with_too_few_tokens() -> None:
    from bench.real_server import server_stalls
    stamps, _ = streams_with_a_stall(None)
    assert server_stalls(stamps, 5.0, 35.0)[0] == []
    assert server_stalls([[0.0, 0.5, 1.0]], 0.0, 2.0) == ([], None)


def test_stall_rates_by_mode_and_their_ratio() -> None:
    from bench.real_server import stall_rates, wilson
    ws = ([{"mode": "full", "wall_s": 3.0, "stalls": [[1.0, 0.3]], "ttft_stalled_ms": [300.0]}] * 4
          + [{"mode": "full", "wall_s": 3.0, "stalls": [], "ttft_stalled_ms": []}] * 16
          + [{"mode": "untraced", "wall_s": 3.0, "stalls": [[0.5, 0.3]], "ttft_stalled_ms": []}] * 2
          + [{"mode": "untraced", "wall_s": 3.0, "stalls": [], "ttft_stalled_ms": []}] * 18
          + [{"mode": "full", "wall_s": 3.0}])  # a record from before: left out
    got = stall_rates(ws)
    assert got is not None
    assert got["by_mode"]["full"]["stalls"] == 4 and got["by_mode"]["full"]["slice_s"] == 60.0
    assert got["by_mode"]["full"]["per_minute"] == 4.0
    assert got["by_mode"]["full"]["requests_stalled"] == 4
    assert got["full_over_untraced"]["ratio"] == 2.0
    lo, hi = got["full_over_untraced"]["ci95"]
    assert lo < 2.0 < hi
    lo, hi = wilson(4, 6)
    assert 0.25 < lo < 4 / 6 < hi < 0.95
    assert stall_rates([{"mode": "full", "wall_s": 3.0}]) is None


def test_refill_adds_the_stalls_to_an_old_result_and_summarises_again(tmp_path: Path) -> None:
    log = synthetic_log(tmp_path, slow=1.0)
    meta = json.loads((log / "slices.json").read_text())
    old = {"results": [{"server": "hf-cb", "slices": [
        {"mode": s["mode"], "round": s["round"], "replica": s["replica"],
         "t0": round(s["t0"] - 100.0, 3), "wall_s": s["wall_s"], "tokens": 900,
         "server_cpu_s": 3.0, "errors": 0, "short_requests": 0, "ttft_ms": [20.0] * 50}
        for s in meta["slices"]]}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    we.refill(tmp_path / "old.json", log, tmp_path / "new.json")
    r = json.loads((tmp_path / "new.json").read_text())["results"][0]
    assert all("stalls" in w and "ttft_stalled_ms" in w for w in r["slices"])
    assert {m: v["stalls"] for m, v in r["stalls"]["by_mode"].items()} == {"full": 0,
                                                                          "untraced": 0}
    assert r["stalls"]["by_mode"]["full"]["slice_s"] == 60.0
