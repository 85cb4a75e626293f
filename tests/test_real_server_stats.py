"""bench/real_server.py's statistics over replicas (``--replicas N``), on synthetic slice
records: the interval is over rounds (per round the mean of its replicas' log ratios),
so it equals the one-replica interval for one replica or perfectly correlated ones and
narrows by ~sqrt(N) for independent ones; old result files (no ``replica``) pool as
replica 0; the census is per token of every replica."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

import pytest

from bench import real_server as rs

Record = dict[str, Any]


def record(mode: str, rnd: int, tokens: float, replica: int | None = 0,
           **extra: Any) -> Record:
    """A slice record as run_slices writes it (1 s long, 0.1 s server CPU per 100
    tokens); ``replica=None``: an old record, without the key."""
    w: Record = {"mode": mode, "round": rnd, "t0": float(rnd), "wall_s": 1.0,
                 "tokens": round(tokens), "server_cpu_s": tokens / 1000.0, "requests": 10,
                 "errors": 0, "short_requests": 0, "ttft_ms": [10.0, 20.0],
                 "server_sys_s": 0.05 + (0.02 if mode != "untraced" else 0.0),
                 "agent_cpu_s": 0.01, "agent_records": 100, **extra}
    if replica is not None:
        w["replica"] = replica
    return w


def slices(log_ratios: list[list[float]], base: list[float] | None = None,
           replica_key: bool = True) -> list[Record]:
    """ABBA slices: ``log_ratios[round][replica]`` is the pair's log(traced/untraced);
    replica i's untraced slice makes ``base[i]`` tokens. Records in run_slices' order:
    each time slice's replicas one after the other."""
    out: list[Record] = []
    for k, row in enumerate(log_ratios, start=1):
        order = ["untraced", "full"] if k % 2 else ["full", "untraced"]
        for mode in order:
            for i, x in enumerate(row):
                b = (base or [10000.0] * len(row))[i]
                tokens = b * math.exp(x) if mode == "full" else b
                out.append(record(mode, k, tokens, i if replica_key else None))
    return out


def same_interval(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in ("ratio", "ci95", "half_width"):
        assert a[key] == b[key], key


def test_one_replica_is_ratio_ci() -> None:
    rng = random.Random(1)
    ratios = [math.exp(rng.gauss(-0.05, 0.1)) for _ in range(40)]
    clustered = rs.clustered_ci([(k, 0, r) for k, r in enumerate(ratios)])
    plain = rs.ratio_ci(ratios)
    for key, value in plain.items():
        assert clustered[key] == value, key
    assert clustered["rounds"] == clustered["pairs"] == 40
    assert clustered["sd_log_round_mean"] == plain["sd_log"]
    assert clustered["replica_correlation"] is None
    assert clustered["effective_pairs"] == 40.0
    # and through summarise: the tokens/s pairs of one replica
    logs = [[math.log(r)] for r in ratios[:12]]
    stats = rs.summarise(slices(logs), ["untraced", "full"])
    plain = rs.ratio_ci([round(10000 * r) / 10000 for r in ratios[:12]])
    for key in ("pairs", "ratio", "ci95", "half_width", "sd_log"):
        assert stats["tokens_per_s"][key] == plain[key], key


def test_correlated_replicas_do_not_narrow_the_interval() -> None:
    rng = random.Random(2)
    logs = [rng.gauss(-0.05, 0.1) for _ in range(12)]
    one = rs.summarise(slices([[x] for x in logs]), ["untraced", "full"])
    three = rs.summarise(slices([[x, x, x] for x in logs]), ["untraced", "full"])
    same_interval(three["tokens_per_s"], one["tokens_per_s"])
    t = three["tokens_per_s"]
    assert (t["pairs"], t["rounds"], t["replicas"]) == (36, 12, 3)
    assert t["replica_correlation"] == 1.0
    assert t["sd_log_round_mean"] == one["tokens_per_s"]["sd_log"]
    # worth the rounds, not the pairs: 3k(k-1)/(3k-1) = 11.31 for k = 12
    assert t["effective_pairs"] == pytest.approx(11.3, abs=0.05)
    # the naive interval over all 36 pairs would be ~sqrt(3) narrower: wrong
    naive = rs.ratio_ci([math.exp(x) for x in logs for _ in range(3)])
    assert naive["half_width"] < 0.62 * t["half_width"]
    # the CPU per token and the added system CPU are clustered the same way
    same_interval(three["server_cpu_per_token"], one["server_cpu_per_token"])
    a, b = one["server_sys"]["full_added_per_s"], three["server_sys"]["full_added_per_s"]
    assert (a["mean"], a["ci95"], a["rounds"]) == (b["mean"], b["ci95"], b["rounds"])
    assert (a["pairs"], b["pairs"]) == (12, 36)


def test_added_system_cpu_is_also_a_share_of_the_server_and_a_cost_per_token() -> None:
    # untraced slices: 10,000 tokens on 10 s of server CPU a second, 0.05 s system;
    # traced: 0.07 s system, tokens 2% or 4% fewer by round (so the interval is real)
    logs = [[math.log(0.98 if k % 2 else 0.96)] for k in range(10)]
    got = rs.summarise(slices(logs), ["untraced", "full"])["server_sys"]
    share = got["full_added_share_of_server_cpu"]
    assert share["mean"] == pytest.approx(0.02 / 10.0) and share["rounds"] == 10
    per_token = got["full_added_us_per_token"]
    want = [(0.07 / round(10000 * r) - 0.05 / 10000) * 1e6 for r in (0.98, 0.96)]
    assert per_token["mean"] == pytest.approx(sum(want) / 2, abs=1e-4)
    # the t-interval over the ten rounds' values, five of each
    hw = rs.t975(9) * statistics.stdev(want * 5) / math.sqrt(10)
    assert per_token["ci95"] == pytest.approx([sum(want) / 2 - hw, sum(want) / 2 + hw],
                                              abs=1e-4)


def test_independent_replicas_narrow_it_by_sqrt_n() -> None:
    rng = random.Random(3)
    rounds = 300
    pairs = [(k, i, math.exp(rng.gauss(-0.05, 0.1))) for k in range(rounds) for i in range(3)]
    three = rs.clustered_ci(pairs)
    one = rs.clustered_ci([p for p in pairs if p[1] == 0])
    ratio = math.log1p(three["half_width"]) / math.log1p(one["half_width"])
    assert 0.5 < ratio < 0.67  # 1/sqrt(3) = 0.577
    assert three["effective_pairs"] == pytest.approx(900, rel=0.2)
    assert abs(three["replica_correlation"]) < 0.15
    assert three["sd_log"] == pytest.approx(0.1, rel=0.1)
    assert three["sd_log_round_mean"] == pytest.approx(0.1 / math.sqrt(3), rel=0.1)


def test_a_shared_round_effect_is_not_averaged_away() -> None:
    """Replicas sharing each round's shock (the switch, the agent): the interval stays
    as wide as the shocks make it, where one over all pairs would not."""
    rng = random.Random(4)
    pairs = []
    for k in range(200):
        shock = rng.gauss(0, 0.1)
        pairs += [(k, i, math.exp(shock + rng.gauss(0, 0.02))) for i in range(4)]
    clustered = rs.clustered_ci(pairs)
    naive = rs.ratio_ci([r for _, _, r in pairs])
    assert clustered["half_width"] > 1.8 * naive["half_width"]
    assert clustered["replica_correlation"] > 0.9
    assert clustered["effective_pairs"] < 250


def test_targets_count_rounds() -> None:
    rng = random.Random(5)
    pairs = [(k, i, math.exp(rng.gauss(0, 0.1))) for k in range(50) for i in range(4)]
    stat = rs.clustered_ci(pairs)
    rs.add_targets(stat, 0.01, 10.0)
    k = rs.pairs_for(stat["sd_log_round_mean"], 0.01)
    assert stat["rounds_for_target"] == k
    assert stat["pairs_for_target"] == 4 * k
    assert stat["seconds_for_target"] == round(10.0 * k)
    one = rs.ratio_ci([math.exp(rng.gauss(0, 0.1)) for _ in range(20)])
    rs.add_targets(one, 0.01, 5.0)  # ratio_ci's dict: per pair, as ever
    assert one["pairs_for_target"] == rs.pairs_for(one["sd_log"], 0.01)


def test_per_replica_and_switch_sequences_stay_within_a_replica() -> None:
    # replica 1 twice as fast as replica 0, tracing free: every ratio within a
    # replica is 1, any pairing across replicas would give 2 or 0.5
    logs = [[0.0, 0.0] for _ in range(8)]
    stats = rs.summarise(slices(logs, base=[5000.0, 10000.0]), ["untraced", "full"])
    per = stats["per_replica"]
    assert [p["replica"] for p in per] == [0, 1]
    assert [p["tokens_per_s_untraced"] for p in per] == [5000.0, 10000.0]
    assert all(p["tokens_per_s"]["ratio"] == 1.0 for p in per)
    effects = stats["switch_effects"]
    nxt = effects["traced_next_vs_after_resume"]
    assert nxt["pairs"] == 8 and nxt["ratio"] == 1.0  # 4 per replica in 8 rounds
    assert effects["untraced_next_vs_after_pause"]["pairs"] == 6
    assert effects["tokens_per_s_pairs_traced_after_resume"]["pairs"] == 8


def test_pool_takes_old_files_as_replica_0(tmp_path: Path) -> None:
    rng = random.Random(6)
    old_logs = [[rng.gauss(-0.05, 0.1)] for _ in range(10)]
    new_logs = [[rng.gauss(-0.05, 0.1), rng.gauss(-0.05, 0.1)] for _ in range(6)]
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"results": [{
        "server": "hf-cb", "mode": "slices", "seconds_per_pair": 7.0,
        "slices": slices(old_logs, replica_key=False)}]}))
    new = tmp_path / "new.json"
    new.write_text(json.dumps({"results": [{
        "server": "hf-cb", "mode": "slices", "seconds_per_pair": 4.5, "seconds_per_round": 9.0,
        "slices": slices(new_logs)}]}))
    alone = rs.pool([str(old)], 0.01)["hf-cb (slices)"]
    direct = rs.summarise(slices(old_logs), ["untraced", "full"])
    same_interval(alone["tokens_per_s"], direct["tokens_per_s"])
    assert alone["replicas"] == 1
    t = alone["tokens_per_s"]
    assert t["pairs"] == t["rounds"] == 10
    assert t["pairs_for_target"] == rs.pairs_for(t["sd_log"], 0.01)
    assert t["seconds_for_target"] == round(7.0 * t["pairs_for_target"])
    both = rs.pool([str(old), str(new)], 0.01)["hf-cb (slices)"]
    t = both["tokens_per_s"]
    assert (t["pairs"], t["rounds"], both["replicas"]) == (10 + 12, 16, 2)
    # per round the mean of its replicas: the old file's rounds one pair, the new two
    means = [x[0] for x in old_logs] + [(a + b) / 2 for a, b in new_logs]
    want = rs.ratio_ci([math.exp(m) for m in means])
    assert t["ratio"] == pytest.approx(want["ratio"], abs=2e-4)
    assert t["ci95"] == pytest.approx(want["ci95"], abs=2e-4)
    # seconds: 10 rounds at 7 s and 6 at 9 s, 124 s for 16 rounds
    assert t["seconds_for_target"] == round(t["rounds_for_target"] * 124 / 16)


def test_pool_keeps_the_parts_of_the_runs_that_had_them(tmp_path: Path) -> None:
    """A part (``sockets-only``) in one run of two: pooled, it is compared over that
    run's rounds alone, against the same rounds' untraced slices; full over both runs."""
    plain = slices([[-0.04]] * 6)
    parted = slices([[-0.04]] * 8)
    for k in range(1, 9):  # each round of the second run a part slice, 1% under untraced
        parted.append(record("sockets-only", k, 10000.0 * math.exp(-0.01 * (k % 2 + 0.5))))
    files = []
    for name, ws in (("a", plain), ("b", parted)):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({"results": [{"server": "hf-cb", "mode": "slices",
                                              "seconds_per_round": 9.0, "slices": ws}]}))
        files.append(str(f))
    pooled = rs.pool(files, 0.01)["hf-cb (slices)"]
    assert pooled["tokens_per_s"]["rounds"] == 14
    assert pooled["tokens_per_s"]["ratio"] == pytest.approx(math.exp(-0.04), abs=1e-4)
    part = pooled["breakdown"]["sockets-only"]["tokens_per_s_vs_untraced"]
    assert part["rounds"] == 8
    assert part["ratio"] == pytest.approx(math.exp(-0.01), abs=1e-4)
    assert pooled["server_sys"]["sockets-only_added_per_s"]["rounds"] == 8
    # a TTFT quantile pooled over runs of different speeds is neither's: none for a part
    assert not [k for k in pooled["breakdown"]["sockets-only"] if k.startswith("ttft_")]


def test_census_is_per_token_of_every_replica() -> None:
    ws = slices([[0.0, 0.0, 0.0]] * 2)
    for k, n in ((3, 1000), (4, 3000)):  # census slices in two rounds, counts on replica 0
        for i in range(3):
            extra = {"programs": {"tt_launch": [n, n * 200]}} if i == 0 else {}
            ws.append(record("census", k, 2000.0, i, **extra))
    census = rs.summarise(ws, ["untraced", "full", "census"])["census"]
    assert census["tokens"] == 4 * 3 * 2000 // 2  # 2 time slices x 3 replicas x 2000
    assert census["seconds"] == 2.0  # time, once per time slice
    assert census["replicas"] == 3
    row = census["programs"]["tt_launch"]
    assert row["runs_per_token"] == round(4000 / 12000, 3)
    assert row["runs_per_s"] == 2000.0
    assert row["ns_per_run"] == 200.0
    # one replica: as ever, per its own tokens
    one = rs.program_census([w for w in ws if w.get("programs")])
    assert one["tokens"] == 4000 and "replicas" not in one


def test_ttft_bootstrap_draws_whole_rounds() -> None:
    ws = slices([[0.0, 0.0]] * 6)
    for w in ws:  # replica 1's traced TTFTs twice its untraced, replica 0's equal
        if w["replica"] == 1 and w["mode"] == "full":
            w["ttft_ms"] = [20.0, 40.0]
    stats = rs.summarise(ws, ["untraced", "full"])
    p50 = stats["ttft_p50"]
    assert p50["ratio"] == pytest.approx(20.0 / 15.0, abs=1e-4)  # pooled over every pair
    # every round holds both replicas: each resample has the same pooled quantiles
    assert p50["ci95"] == [p50["ratio"], p50["ratio"]]


def test_cpu_plan() -> None:
    assert rs.plan_cpus(16) == {"agent": {0}, "client": {1, 2}, "server": set(range(3, 16))}
    assert rs.plan_cpus(4) == {"agent": {0}, "client": {1}, "server": {2, 3}}
    assert rs.plan_cpus(2) == {"agent": {1}, "client": {0}, "server": {0}}
    plan = rs.plan_lanes(4, 1, 64)
    assert plan.agent == {0} and not plan.shared
    assert [lane["client"] for lane in plan.lanes] == [{1, 2}, {16, 17}, {31, 32}, {46, 47}]
    assert all(len(lane["server"]) == 13 for lane in plan.lanes)
    assert plan.unused == {61, 62, 63}
    assert rs.plan_lanes(2, 2, 8).agent == {0, 1}


def test_a_small_host_shares_every_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    plan = rs.plan_lanes(2, 1, 6)
    assert plan.shared and plan.agent == set(range(6))
    assert all(lane["server"] == lane["client"] == set(range(6)) for lane in plan.lanes)
    assert "too few" in capsys.readouterr().err
    assert plan.as_json()["replicas"][1]["server"] == list(range(6))


def test_sched_counts_are_per_token_and_traced_against_untraced() -> None:
    ws = slices([[0.0, 0.0]] * 4)  # the same tokens traced and untraced
    for w in ws:
        traced = w["mode"] == "full"
        w["server_voluntary_switches"] = 3 * w["tokens"] if traced else 2 * w["tokens"]
        w["server_involuntary_switches"] = w["tokens"] // 100
        w["server_run_delay_s"] = 0.02 if traced else 0.01
    sched = rs.summarise(ws, ["untraced", "full"])["server_sched"]
    assert sched["untraced"]["voluntary_per_token"] == 2.0
    assert sched["full"]["voluntary_per_token"] == 3.0
    assert sched["full"]["involuntary_per_token"] == 0.01
    assert sched["full"]["run_delay_per_s"] == 0.02
    assert sched["full_voluntary_per_token_vs_untraced"]["ratio"] == 1.5


def test_servers_narrowed_to_their_first_cpus() -> None:
    plan = rs.plan_lanes(4, 1, 64)
    before = [sorted(lane["server"]) for lane in plan.lanes]
    plan.narrow_servers([13, 1, 2])
    assert [sorted(lane["server"]) for lane in plan.lanes] == [
        before[0], before[1][:1], before[2][:2], before[3][:2]]
    assert plan.unused == {61, 62, 63} | set(before[1][1:]) | set(before[2][2:]) \
        | set(before[3][2:])


def test_host_speed_is_per_time_slice_and_traced_against_untraced() -> None:
    ws = slices([[0.0, 0.0]] * 6)
    for w in ws:
        if w["replica"] == 0:  # the bench puts the host's meters on replica 0's record
            slow = 0.9 if w["mode"] == "full" else 1.0
            w["host_speed"] = {"cpu": 1000.0 * slow, "cache": 500.0 + w["round"]}
    speed = rs.summarise(ws, ["untraced", "full"])["host_speed"]
    assert speed["cpu"]["untraced"] == 1000.0 and speed["cpu"]["full"] == 900.0
    assert speed["cpu"]["full_vs_untraced"]["ratio"] == 0.9
    assert speed["cpu"]["full_vs_untraced"]["rounds"] == 6
    assert speed["cache"]["full_vs_untraced"]["ratio"] == 1.0
    assert "untraced_correlation_with_tokens_per_s" not in speed["cpu"]  # tokens flat


def test_speed_meters_count_on_their_cpus(tmp_path: Path) -> None:
    import os
    import time
    from bench.host_speed import SpeedMeters
    cpu = sorted(os.sched_getaffinity(0))[-1]
    meters = SpeedMeters(tmp_path, [cpu, cpu])
    try:
        meters.wait_started()
        a = meters.read()
        time.sleep(0.3)
        b = meters.read()
    finally:
        meters.close()
    assert set(a) == {"cpu", "cache"}
    assert all(b[k] > a[k] > 0 for k in a)


def test_profiled_agent_writes_its_profile_and_collections(tmp_path: Path) -> None:
    import pstats
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    prefix = tmp_path / "agent"
    capture = root / "samples" / "captures" / "openai-http1.ttcap"
    done = subprocess.run([sys.executable, str(root / "bench" / "profiled_agent.py"),
                           str(prefix), "replay", str(capture), "-q"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    stats = pstats.Stats(str(prefix) + ".prof")
    assert any(name == "feed" for _, _, name in stats.stats)  # type: ignore[attr-defined]
    gc = json.loads(Path(str(prefix) + "-gc.json").read_text())
    assert set(gc["collections"]) == {"0", "1", "2"} and gc["objects_tracked"] > 0


def host_drift_slices(design: str, rounds: int, effect: float, seed: int) -> list[Record]:
    """Four replicas whose tokens/s move together by a host factor of sd 0.15 per time
    slice (as the lent H100 hosts' do) and by 0.02 each: ``alternate`` traces all four
    in one slice of a round, ``crossover`` replicas 0 and 2 in one and 1 and 3 in the
    other (``run_crossover``'s halves, in ABBA order); tracing costs ``effect`` in log
    tokens/s."""
    rng = random.Random(seed)
    out: list[Record] = []
    for k in range(1, rounds + 1):
        for s in range(2):
            host = rng.gauss(0.0, 0.15)
            for i in range(4):
                if design == "alternate":
                    traced = (s == 1) == (k % 2 == 1)
                else:
                    half = (0, 1)[s] if k % 2 == 1 else (1, 0)[s]
                    traced = i % 2 == half
                x = host + rng.gauss(0.0, 0.02) + (effect if traced else 0.0)
                out.append(record("full" if traced else "untraced", k,
                                  10000.0 * math.exp(x), i))
    return out


def test_crossover_cancels_the_host_drift_the_alternating_design_keeps() -> None:
    """The same host drift, 30 rounds: the crossover's round means take each half's
    traced slice against the other's at the same moment, so the drift cancels and the
    interval is a few times narrower than the alternating design's, around the same
    true ratio; both intervals hold it."""
    effect = math.log(0.99)
    cross = rs.summarise(host_drift_slices("crossover", 30, effect, 3),
                         ["untraced", "full"])["tokens_per_s"]
    alt = rs.summarise(host_drift_slices("alternate", 30, effect, 3),
                       ["untraced", "full"])["tokens_per_s"]
    for t in (cross, alt):
        assert t["rounds"] == 30 and t["replicas"] == 4 and t["pairs"] == 120
        assert t["ci95"][0] <= 0.99 <= t["ci95"][1]
    assert cross["half_width"] < 0.012  # ~0.02 / sqrt(4) a round, 30 rounds
    assert alt["half_width"] > 3 * cross["half_width"]
    # the halves move against each other within a round: negative replica correlation
    assert cross["replica_correlation"] < 0 < alt["replica_correlation"]


def test_pool_keeps_designs_apart(tmp_path: Path) -> None:
    """A crossover run's rounds are not pooled with an alternating run's: their noise
    differs, so each design is its own key."""
    files = []
    for design in ("alternate", "crossover"):
        f = tmp_path / f"{design}.json"
        f.write_text(json.dumps({"results": [{
            "server": "hf-cb", "mode": "slices", "design": design, "seconds_per_round": 12.0,
            "slices": host_drift_slices(design, 6, math.log(0.99), 5)}]}))
        files.append(str(f))
    pooled = rs.pool(files, 0.01)
    assert pooled["hf-cb (slices)"]["tokens_per_s"]["rounds"] == 6
    assert pooled["hf-cb (slices, crossover)"]["tokens_per_s"]["rounds"] == 6


def test_pool_writes_to_out_when_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--pool FILES --out F` keeps what it prints in F, as a run keeps its result."""
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"results": [{
        "server": "hf-cb", "mode": "slices", "design": "crossover", "seconds_per_round": 12.0,
        "slices": host_drift_slices("crossover", 6, math.log(0.99), 5)}]}))
    out = tmp_path / "pooled" / "both.json"
    assert rs.main(["--pool", str(f), "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == printed
    assert printed["hf-cb (slices, crossover)"]["tokens_per_s"]["rounds"] == 6


def test_crossover_needs_an_even_number_of_replicas_and_no_breakdown() -> None:
    for argv in (["--design", "crossover", "--replicas", "3"],
                 ["--design", "crossover", "--replicas", "4", "--breakdown"],
                 ["--design", "crossover", "--replicas", "2", "--mode", "windows"]):
        with pytest.raises(SystemExit) as e:
            rs.main(argv)
        assert e.value.code == 2


def test_crossover_plan_snakes_the_halves_through_each_modes_two_slices() -> None:
    """Without variants the plan is the ABBA order of before; with one, each mode takes
    both halves in turn, the traced agent changing only within a mode's two slices
    (F0 F1 V1 V0 | V0 V1 F1 F0 | ...), and a null slice takes each place in turn."""
    assert [rs.crossover_plan(k, []) for k in (1, 2, 3)] == [
        [(0, "full"), (1, "full")], [(1, "full"), (0, "full")], [(0, "full"), (1, "full")]]
    v = "net-syscall"
    null = (None, "none-traced")
    assert rs.crossover_plan(1, [v], 4) == [(0, "full"), (1, "full"), (1, v), (0, v), null]
    assert rs.crossover_plan(1, [v], 0) == [null, (0, "full"), (1, "full"), (1, v), (0, v)]
    assert rs.crossover_plan(3, [], 4) == [(0, "full"), null, (1, "full")]
    # --null-every 4: the k-th null round (round 4k) has it at place k - 1, every place
    # of a round's three in turn
    places = [rs.null_place(k, 4) for k in range(1, 25)]
    assert [p for p in places if p is not None] == list(range(6))
    assert [k for k, p in enumerate(places, 1) if p is not None] == [4, 8, 12, 16, 20, 24]
    assert [[w[0] for w in rs.crossover_plan(k, [], rs.null_place(k, 4))].index(None)
            for k in (4, 8, 12, 16)] == [0, 1, 2, 0]
    assert rs.null_place(3, 0) is None
    assert rs.crossover_plan(2, [v]) == [(0, v), (1, v), (1, "full"), (0, "full")]
    seq = [p for k in range(1, 5) for p in rs.crossover_plan(k, [v])]
    # a pause and a resume only where the half changes: once per mode, never between
    changes = sum(a[0] != b[0] for a, b in zip(seq, seq[1:]))
    assert changes == 8 and all(a[0] == b[0] for a, b in zip(seq[1::2], seq[2::2]))


def variant_slices(rounds: int, full: float, variant: float, seed: int) -> list[Record]:
    """Four replicas under a host drift of sd 0.15 a time slice, in
    ``crossover_plan``'s slices with one variant (``net-syscall``): the traced half's
    tokens/s falls by ``full`` or ``variant`` in log, and its system CPU per token
    rises by 9 us (full) or 4 us (variant)."""
    rng = random.Random(seed)
    out: list[Record] = []
    for k in range(1, rounds + 1):
        for half, mode in rs.crossover_plan(k, ["net-syscall"]):
            host = rng.gauss(0.0, 0.15)
            for i in range(4):
                traced = i % 2 == half
                x = host + rng.gauss(0.0, 0.02)
                if traced:
                    x += full if mode == "full" else variant
                tokens = 1000.0 * math.exp(x)
                sys_us = 50.0 + (0.0 if not traced else 9.0 if mode == "full" else 4.0)
                w = record(mode if traced else rs.baseline_of(mode), k, tokens, i)
                w["server_sys_s"] = w["tokens"] * sys_us * 1e-6
                w["server_cpu_s"] = w["tokens"] * (1000.0 + sys_us) * 1e-6
                out.append(w)
    return out


def test_a_variant_is_set_against_its_own_untraced_slices_and_paired_with_full() -> None:
    """``--variants``: the variant's tokens/s over the untraced half of its own slices
    holds its true cost, its ratio to full's (each over its own untraced slices, by
    round) holds the true difference, and the added system CPU a token of each, and the
    difference, come out exactly."""
    ws = variant_slices(30, math.log(0.985), math.log(0.995), 4)
    modes = ["untraced", "full", "net-syscall", "untraced@net-syscall"]
    out = rs.summarise(ws, modes)
    assert out["tokens_per_s"]["pairs"] == 120
    assert out["tokens_per_s"]["ci95"][0] <= 0.985 <= out["tokens_per_s"]["ci95"][1]
    part = out["breakdown"]["net-syscall"]
    assert set(out["breakdown"]) == {"net-syscall"}
    vs_u, vs_f = part["tokens_per_s_vs_untraced"], part["tokens_per_s_vs_full"]
    assert vs_u["pairs"] == vs_f["pairs"] == 120
    assert vs_u["ci95"][0] <= 0.995 <= vs_u["ci95"][1]
    assert vs_f["ci95"][0] <= 0.995 / 0.985 <= vs_f["ci95"][1]
    assert vs_f["half_width"] < 0.012
    sys = out["server_sys"]
    assert sys["full_added_us_per_token"]["mean"] == pytest.approx(9.0, abs=0.002)
    assert sys["net-syscall_added_us_per_token"]["mean"] == pytest.approx(4.0, abs=0.002)
    assert sys["net-syscall_minus_full_added_us_per_token"]["mean"] == pytest.approx(-5.0, abs=0.002)
    assert "untraced@net-syscall_added_per_s" not in sys
    # the share of full's added server CPU a token the variant saves: 5 us of 9
    assert part["share_of_added_server_cpu"] == pytest.approx(5 / 9, abs=0.002)


def test_variants_take_the_crossover_and_modes_an_agent_sets_alone() -> None:
    for argv in (["--variants", "net-syscall"],
                 ["--design", "crossover", "--replicas", "2", "--variants", "census"],
                 ["--design", "crossover", "--replicas", "2", "--variants", "bogus"]):
        with pytest.raises(SystemExit) as e:
            rs.main(argv)
        assert e.value.code == 2


def test_hf_cb_servers_sharing_a_gpu_split_its_cache_memory() -> None:
    """HF serve CB sizes its KV cache from its own process's memory counters, as if the
    GPU were its alone: servers sharing one are each given a share, together 0.8 of it;
    one alone keeps transformers' own default."""
    from bench.real_server import cb_memory_args

    assert cb_memory_args(1) == []
    for n in (2, 4):
        flag, share = cb_memory_args(n)
        assert flag == "--cb-max-memory-percent"
        assert n * float(share) == pytest.approx(0.8, abs=1e-3)


def test_a_part_has_its_own_ttft_quantiles_against_untraced_and_full() -> None:
    """A duty-cycle slice each round: its TTFTs pooled against the round's untraced
    slices and against its full slices, not left to full's ratios alone."""
    ws = slices([[0.0]] * 6)
    for w in ws:
        if w["mode"] == "full":
            w["ttft_ms"] = [12.0, 24.0]  # full 1.2x untraced's [10, 20]
    for k in range(1, 7):
        ws.append(record("duty-0.2", k, 10000.0, ttft_ms=[11.0, 22.0]))
    part = rs.summarise(ws, ["untraced", "full", "duty-0.2"])["breakdown"]["duty-0.2"]
    assert part["ttft_p50_vs_untraced"]["ratio"] == pytest.approx(16.5 / 15.0, abs=1e-4)
    assert part["ttft_p50_vs_full"]["ratio"] == pytest.approx(16.5 / 18.0, abs=1e-4)
    assert part["ttft_p99_vs_untraced"]["ratio"] == pytest.approx(21.89 / 19.9, abs=1e-3)
    # the same in every round: every resample gives the point
    assert part["ttft_p50_vs_full"]["ci95"] == [part["ttft_p50_vs_full"]["ratio"]] * 2


def test_a_slow_first_place_in_the_round_is_told_apart_from_the_modes() -> None:
    """Each round's first slice 2% slow, whatever its mode (the pairs' order alternates,
    so it is full's in half the rounds): by place, untraced@0 and full@0 are both ~2%
    under the round's mean and @1 above it, while the pair ratios alone would split
    into 0.98 and 1/0.98 by which slice came first."""
    ws = slices([[0.0]] * 8)
    for w in ws:
        first = ("untraced" if w["round"] % 2 else "full") == w["mode"]
        if first:
            w["tokens"] = round(w["tokens"] * 0.98)
    places = rs.summarise(ws, ["untraced", "full"])["switch_effects"]["by_position"]
    assert set(places) == {"untraced@0", "untraced@1", "full@0", "full@1"}
    for mode in ("untraced", "full"):
        assert places[f"{mode}@0"]["mean"] == pytest.approx(math.sqrt(0.98), abs=2e-4)
        assert places[f"{mode}@1"]["mean"] == pytest.approx(1 / math.sqrt(0.98), abs=2e-4)
        assert places[f"{mode}@0"]["rounds"] == 4


def test_runs_quantile_ratios_combine_by_their_intervals() -> None:
    """Two runs' own p99 ratios: the narrower interval weighs more; agreeing runs give
    a heterogeneity q under their number less one, a run far off a large one."""
    a = {"ratio": 1.02, "ci95": [1.00, 1.04]}
    b = {"ratio": 0.98, "ci95": [0.90, 1.06]}
    c = rs.combine_ratios([a, b, None])
    assert c is not None and c["runs"] == 2
    assert 0.98 < c["ratio"] < 1.02 and abs(c["ratio"] - 1.02) < abs(c["ratio"] - 0.98)
    assert c["ci95"][0] < c["ratio"] < c["ci95"][1]
    assert c["ci95"][1] - c["ci95"][0] < 0.04  # narrower than either run's
    far = rs.combine_ratios([a, {"ratio": 1.3, "ci95": [1.28, 1.32]}])
    assert far["q"] > 10 > c["q"]
    assert rs.combine_ratios([a]) is None


def placed_slices(null_places: list[int | None], modes_effect: dict[str, float],
                  place_effect: dict[tuple[int, int], float]) -> list[Record]:
    """One replica's slices, round r (1, 2, ...) full and untraced in ABBA order with a
    null slice at ``null_places[r - 1]`` (None: no null that round); each slice's
    tokens its mode's effect x its place's (by round size) x a level of the round's
    own (the host's drift), and its t0 its place."""
    ws: list[Record] = []
    for r, null in enumerate(null_places, start=1):
        plan = ["full", "untraced"] if r % 2 else ["untraced", "full"]
        if null is not None:
            plan.insert(null, rs.NONE_TRACED)
        level = 1e7 * (1.0 + 0.1 * math.sin(r))  # large: rounding to whole tokens is noise
        for place, mode in enumerate(plan):
            w = record(mode, r, level * modes_effect[mode]
                       * place_effect.get((len(plan), place), 1.0))
            w["t0"] = r * 10.0 + place
            ws.append(w)
    return ws


MODE_EFFECTS = {"untraced": 1.0, "full": 0.99, rs.NONE_TRACED: 1.005}
# forty rounds, a null in every second one: always last, or at each place in turn
NULL_LAST = [2 if r % 2 == 0 else None for r in range(1, 41)]
NULL_ROTATING = [(r // 2) % 3 if r % 2 == 0 else None for r in range(1, 41)]


def test_place_adjusted_takes_the_null_slices_place_out() -> None:
    """Null slices always last in their round, where no first-place slowness reaches
    them: the pair ratio puts that slowness into the null's effect; the fit with the
    places recovers each mode's own (here exactly: no noise), given rounds whose null
    takes another place. With the null last in every round nothing tells its place from
    its mode: not identified."""
    modes = MODE_EFFECTS
    places = {(3, 0): 0.97, (2, 1): 0.995}
    fixed, rotating = NULL_LAST, NULL_ROTATING
    ws = placed_slices(fixed + rotating, modes, places)
    out = rs.place_adjusted(ws, draws=50)
    assert out is not None and out["identified"]
    assert out["full_vs_untraced"]["ratio"] == pytest.approx(0.99, abs=2e-4)
    assert out[f"{rs.NONE_TRACED}_vs_untraced"]["ratio"] == pytest.approx(1.005, abs=2e-4)
    assert out[f"full_vs_{rs.NONE_TRACED}"]["ratio"] == pytest.approx(0.99 / 1.005, abs=2e-4)
    assert out["places"]["2@1"]["ratio"] == pytest.approx(0.995, abs=2e-4)
    assert out["places"]["3@1"]["ratio"] == pytest.approx(1 / 0.97, abs=2e-4)
    lo, hi = out["full_vs_untraced"]["ci95"]
    assert lo <= 0.99 <= hi
    # the pair ratios of the same slices: the null's, biased by the first place's 3%
    naive = rs.summarise(ws, ["untraced", "full", rs.NONE_TRACED])["breakdown"][
        rs.NONE_TRACED]["tokens_per_s_vs_untraced"]["ratio"]
    assert naive > 1.01
    # the null always last: its place and its mode go together
    last = placed_slices(fixed, modes, places)
    assert rs.place_adjusted(last, draws=20) == {"identified": False, "slices": len(last)}


def test_place_adjusted_fits_each_runs_places_apart() -> None:
    """Two runs pooled, as ``pool`` numbers them: the first (another host) with its
    null always last and its last place 3% slow, the second with its null at every
    place and no place effect. Places shared by both runs would spread the first's
    slow last place over the second's nulls and charge the rest to the null's own
    effect; fitted per run, the first run's nulls go with its own last place, and the
    second gives the null's effect exactly."""
    first = placed_slices(NULL_LAST, MODE_EFFECTS, {(3, 2): 0.97})
    second = placed_slices(NULL_ROTATING, MODE_EFFECTS, {})
    pooled = ([dict(w, run=0) for w in first]
              + [dict(w, run=1, round=w["round"] + 100000) for w in second])
    out = rs.place_adjusted(pooled, draws=50)
    assert out is not None and out["identified"]
    assert out[f"{rs.NONE_TRACED}_vs_untraced"]["ratio"] == pytest.approx(1.005, abs=2e-4)
    assert out[f"full_vs_{rs.NONE_TRACED}"]["ratio"] == pytest.approx(0.99 / 1.005, abs=2e-4)
    assert out["full_vs_untraced"]["ratio"] == pytest.approx(0.99, abs=2e-4)
    assert set(out["places"]) == {f"{run}:{n}@{p}" for run in (0, 1)
                                  for n, p in ((2, 1), (3, 1), (3, 2))}
    assert out["places"]["0:3@2"]["ratio"] == pytest.approx(0.97, abs=2e-4)
    # the same slices with the places shared: the first run's slow last place is
    # charged to the null in part
    shared = rs.place_adjusted([dict(w, run=0) for w in pooled], draws=20)
    assert shared is not None and shared["identified"]
    assert shared[f"{rs.NONE_TRACED}_vs_untraced"]["ratio"] < 1.005 - 0.003
