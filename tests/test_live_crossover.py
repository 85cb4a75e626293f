"""``bench/real_server.py --design crossover`` on a real server under real probes: two
agents, each tracing half the replicas, one half traced in each time slice and the
halves swapped, every replica still paired with itself over a round; ``--variants
net-syscall``: each half also traced with the socket-level timing switched off live
(``tokentrace ctl SOCK net-timing syscall``), against the other half untraced at the
same moments."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def one_lane(tmp_path: Path, args: argparse.Namespace) -> Iterator[tuple[Any, Any, Any]]:
    """The bench's batching sample on the CPU as one replica with its load client
    (not started): (the bench module, the server, its lane); both stopped after."""
    sys.path.insert(0, str(ROOT))
    from bench import real_server as rs
    work = tmp_path / "replica-0"
    work.mkdir()
    server = rs.Server("batching", "cpu", work, {0, 1})
    lane = rs.Lane(0, server)
    try:
        lane.client = rs.Client(server, args, {0, 1})
        yield rs, server, lane
    finally:
        if lane.client is not None:
            lane.client.close()
        server.stop()


def test_each_time_slice_traces_one_half_and_each_replica_pairs_with_itself(tmp_path):
    out = tmp_path / "xo.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "real_server.py"),
                          "--servers", "batching", "--replicas", "2", "--design", "crossover",
                          "--budget-s", "28", "--min-pairs", "2", "--slice-s", "1",
                          "--settle-resume-s", "0.5", "--warmup-s", "2", "--null-every", "1",
                          "--variants", "net-syscall", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())["results"][0]
    assert r["design"] == "crossover" and r["errors"] == 0
    by_slice: dict[float, dict[int, str]] = defaultdict(dict)
    for w in r["slices"]:
        by_slice[w["t0"]][w["replica"]] = w["mode"]
        assert w["tokens"] > 0
    # every time slice: replica 0 and replica 1 in opposite modes (full or the
    # variant against the untraced slice of its own moments), but for each round's
    # null slice (--null-every 1), where neither is traced
    null = [t for t, m in by_slice.items() if set(m.values()) == {"none-traced"}]
    rounds = len({w["round"] for w in r["slices"]})
    assert len(null) == rounds >= 2
    assert all(sorted(m.values()) in (["full", "untraced"],
                                      ["net-syscall", "untraced@net-syscall"])
               for t, m in by_slice.items() if t not in null)
    # the halves snake through each mode's two slices, the modes' order turned each round;
    # the null slice first in the first round, second in the next
    firsts = [m[0] for _, m in sorted(by_slice.items())]
    assert firsts[:10] == ["none-traced", "full", "untraced", "untraced@net-syscall",
                           "net-syscall", "net-syscall", "none-traced",
                           "untraced@net-syscall", "untraced", "full"]
    # the null slices against each replica's untraced one: what the traced half's
    # probes cost the untraced half
    assert "none-traced_added_per_s" in r["server_sys"]
    assert r["breakdown"]["none-traced"]["tokens_per_s_vs_untraced"]["pairs"] == 2 * len(null)
    # the variant, each over its own untraced slices and paired with full by round
    v = r["breakdown"]["net-syscall"]
    assert v["tokens_per_s_vs_full"]["pairs"] == v["tokens_per_s_vs_untraced"]["pairs"] \
        == 2 * rounds
    assert "net-syscall_minus_full_added_us_per_token" in r["server_sys"]
    t = r["tokens_per_s"]
    assert t["replicas"] == 2 and t["rounds"] >= 2 and t["pairs"] == 2 * t["rounds"]
    # each slice's stalls of its server, counted by mode (this server does not stall)
    assert all("stalls" in w and "ttft_stalled_ms" in w for w in r["slices"])
    assert {"full", "untraced", "none-traced"} <= set(r["stalls"]["by_mode"])
    assert r["ttft_p99_outside_stalls"]["ratio"] > 0
    # each agent traced its own replica, and only while its half was traced
    assert len(r["agents"]) == 2
    for g, a in enumerate(r["agents"]):
        assert a["launches_traced"] > 0, g
        assert 0 < a["seconds_in_mode"]["full"] < a["seconds_in_mode"]["all"]
        assert 0 < a["seconds_in_mode"]["net-syscall"] < a["seconds_in_mode"]["all"]
        assert a["records_per_s"] > 0


def test_a_replica_whose_tokens_do_not_come_is_restarted_once(tmp_path):
    """A server that takes the load's connections but never answers (here stopped with
    SIGSTOP; HF serve CB has stalled so before its first token on shared GPUs) is
    restarted on a new port once its first tokens are overdue, and the load goes on
    from the new one; the run says which replica it restarted."""
    args = argparse.Namespace(requests=8, concurrency=2, max_tokens="4:8", keep_eos=False,
                              first_tokens_s=6.0, warmup_s=0.0)
    with one_lane(tmp_path, args) as (rs, server, lane):
        old_port, old_pid = server.port, server.pid
        os.killpg(server.pid, signal.SIGSTOP)
        out: dict = {}
        rs.start_loads([lane], args, out)
        assert out["replicas_restarted"] == [0]
        assert server.port != old_port and server.pid != old_pid
        assert lane.client.slice(time.monotonic() - 1.0, time.monotonic())["tokens"] > 0
        assert "restarted on port" in server.log.read_text()
        rs.stop_loads([lane], out)
        assert out["load"]["tokens"] > 0 and out["load"]["errors"] == 0


def test_a_server_stopped_mid_load_is_one_stall_of_its_slice(tmp_path):
    """The batching sample under the bench's load, stopped (SIGSTOP) for 0.4 s: the
    client's slice finds one stall of the whole server of about that length, where its
    streams went silent, and none in a slice without the stop; a request that waited
    through it for its first token is listed apart."""
    args = argparse.Namespace(requests=16, concurrency=4, max_tokens="16:32", keep_eos=False,
                              first_tokens_s=60.0, warmup_s=3.0)
    with one_lane(tmp_path, args) as (rs, server, lane):
        rs.start_loads([lane], args, {})
        t0 = time.monotonic()
        time.sleep(1.0)
        os.killpg(server.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        time.sleep(0.4)
        os.killpg(server.pid, signal.SIGCONT)
        time.sleep(1.5)
        t1 = time.monotonic()
        time.sleep(2.0)
        stalled = lane.client.slice(t0, t1)
        quiet = lane.client.slice(t1 + 0.2, time.monotonic() - 0.1)
        assert stalled["stall_threshold_s"] is not None
        assert len(stalled["stalls"]) == 1, stalled["stalls"]
        start, length = stalled["stalls"][0]
        assert 0.35 < length < 0.6 and abs(t0 + start - stopped) < 0.1
        assert quiet["stalls"] == [] and quiet["tokens"] > 0
        assert all(x > 300 for x in stalled["ttft_stalled_ms"])
        assert len(stalled["ttft_stalled_ms"]) <= stalled["requests"]
