"""The continuous-batching sample servers, on the stand-in libcuda/libnccl, driven by
the openai client at concurrency 8: their ground truth must agree with what the
clients received and with the stand-ins' own call counts."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from samples.batching import truth as truthfile
from samples.gpu.build import build
from samples.launch import ROOT, SampleServer
from tests.conftest import free_port

MAX_BATCH = 4
CHUNK = 16
REQUESTS = 32
CONCURRENCY = 8
KERNEL_NS = 5000


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    return build(tmp_path_factory.mktemp("gpu"))


def _post(url: str, doc: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(doc).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _serve_and_load(layout: str, standins, tmp: Path):
    truth, counts = tmp / "truth.jsonl", tmp / "cuda.json"
    args = ["--layout", layout, "--device", "cpu", "--truth", str(truth),
            "--max-batch", str(MAX_BATCH), "--prefill-chunk", str(CHUNK),
            "--libcuda", str(standins["libcuda"])]
    if layout == "tp2":
        args += ["--libnccl", str(standins["libnccl"])]
    env = {"TT_STANDIN_COUNTS": str(counts), "TT_STANDIN_NCCL_COUNTS": str(tmp / "nccl.json"),
           "TT_STANDIN_KERNEL_NS": str(KERNEL_NS)}
    server = SampleServer("samples.batching.server", port=free_port(), args=args,
                          log=tmp / "server.log", env=env)
    with server:
        if layout == "thread":  # bad input: a clear error, and the server goes on
            url = server.base_url + "/v1/completions"
            assert _post(url, {"model": "nope", "prompt": "x"})[0] == 404
            assert _post(url, {"model": "tiny-gpt", "prompt": "x", "max_tokens": 0})[0] == 400
        out = tmp / "load.json"
        r = subprocess.run([sys.executable, "-m", "samples.batching.load", "--url",
                            server.base_url, "--requests", str(REQUESTS), "--concurrency",
                            str(CONCURRENCY), "--out", str(out), "--seed", "3"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        records = truthfile.read(truth)
        engine_pids = {s["pid"] for s in records if s["type"] == "step"}
        parents = {pid: _parent(pid) for pid in engine_pids}
    seen = json.loads(out.read_text())
    ranks = 2 if layout == "tp2" else 1
    if layout == "thread":
        standin = {0: json.loads(counts.read_text())}
        nccl = {}
    else:
        standin = {r: json.loads(Path(f"{counts}.rank{r}").read_text()) for r in range(ranks)}
        nccl = ({r: json.loads((tmp / f"nccl.json.rank{r}").read_text()) for r in range(ranks)}
                if layout == "tp2" else {})
    return server.pid, parents, truthfile.read(truth), seen, standin, nccl


@pytest.mark.parametrize("layout", ["thread", "process", "tp2"])
def test_truth_matches_clients_and_standin_counts(layout, standins, tmp_path):
    api_pid, parents, records, seen, standin, nccl = _serve_and_load(layout, standins, tmp_path)
    assert not seen["errors"]
    steps = defaultdict(list)
    for rec in records:
        if rec["type"] == "step":
            steps[rec["rank"]].append(rec)
    requests = {r["id"]: r for r in records if r["type"] == "request"}
    ranks = sorted(steps)
    assert ranks == ([0, 1] if layout == "tp2" else [0])

    # Where the engine ran: this process, or children of it (one per rank).
    pids = {r: {s["pid"] for s in steps[r]} for r in ranks}
    assert all(len(p) == 1 for p in pids.values())
    if layout == "thread":
        assert pids[0] == {api_pid}
    else:
        assert len(set().union(*pids.values())) == len(ranks) and api_pid not in parents
        assert all(parents[pid] == api_pid for pid in parents)
    for r in ranks:
        assert len({s["tid"] for s in steps[r]}) == 1  # one engine thread per rank

    # Every step: members within the batch limit, the launch formula, GPU time.
    for r in ranks:
        assert [s["step"] for s in steps[r]] == list(range(1, len(steps[r]) + 1))
        prev_end = 0
        for s in steps[r]:
            m = s["members"]
            assert 1 <= len(m) <= MAX_BATCH and len({x["id"] for x in m}) == len(m)
            pre = sum(x["phase"] == "prefill" for x in m)
            assert s["launches"] == 6 + 3 * pre + (len(m) - pre)
            # a block per query token: a prefill's kernels cost its chunk's tokens
            for x in m:
                assert x["time_ns"] == x["cost"] * (x["tokens"] if x["phase"] == "prefill"
                                                    else 1) * KERNEL_NS
            assert s["gpu_ns"] == (6 * KERNEL_NS + sum(x["time_ns"] for x in m))
            assert prev_end < s["t_start_ns"] < s["t_end_ns"]
            assert s["t_end_ns"] - s["t_start_ns"] >= s["gpu_ns"]  # the stand-in waited
            prev_end = s["t_end_ns"]
        # The stand-in's own counts, per process: one sync, one H2D, one D2H per step.
        c = standin[r]
        assert c["launches"] == sum(s["launches"] for s in steps[r])
        assert c["sync_calls"] == c["h2d_calls"] == c["d2h_calls"] == len(steps[r])
        assert c["query_calls"] == 0 and c["graph_launches"] == 0
        assert c["h2d_bytes"] == 4 * sum(x["tokens"] for s in steps[r] for x in s["members"])
        assert c["d2h_bytes"] == 4 * sum(len(s["members"]) for s in steps[r])
        if nccl:
            assert nccl[r]["allreduce"][0] == len(steps[r]) and nccl[r]["comm_init"][0] == 1
    if layout == "tp2":  # rank 1 ran rank 0's plans, step for step
        assert [s["members"] for s in steps[1]] == [s["members"] for s in steps[0]]
        assert steps[0][0]["pid"] != steps[1][0]["pid"]

    # The batch filled up, queued requests waited, long prompts were prefilled in chunks.
    sizes = Counter(len(s["members"]) for s in steps[0])
    assert max(sizes) == MAX_BATCH
    emits, prefill_steps, prefill_tokens = Counter(), Counter(), Counter()
    for s in steps[0]:
        for x in s["members"]:
            emits[x["id"]] += x["emits"]
            if x["phase"] == "prefill":
                prefill_steps[x["id"]] += 1
                prefill_tokens[x["id"]] += x["tokens"]
                assert x["tokens"] <= CHUNK
    assert max(prefill_steps.values()) > 1

    # Every request: the truth, the engine's steps and the client agree on tokens.
    assert set(requests) == set(seen["requests"]) and len(requests) == REQUESTS
    for rid, req in requests.items():
        got = seen["requests"][rid]
        assert req["output_tokens"] == emits[rid] == got["tokens"] == got["max_tokens"]
        assert req["prompt_tokens"] == prefill_tokens[rid]
        assert req["streamed"] == got["streamed"]
        if got["usage"]:
            assert got["usage"]["completion_tokens"] == req["output_tokens"]
            assert got["usage"]["prompt_tokens"] == req["prompt_tokens"]
        first = next(s for s in steps[0] if any(x["id"] == rid for x in s["members"]))
        assert req["admitted_ns"] == first["t_start_ns"]
        assert req["arrival_ns"] <= req["admitted_ns"] < req["first_token_ns"] <= req["end_ns"]


def test_scheduler_fifo_batch_limit_and_chunked_prefill():
    from samples.batching.engine import Scheduler, Seq

    s = Scheduler(max_batch=2, prefill_chunk=4, block=128)
    s.add(Seq("a", list(range(10)), max_tokens=2))  # 3 prefill steps: 4 + 4 + 2
    s.add(Seq("b", [1], max_tokens=1))
    s.add(Seq("c", [1, 2], max_tokens=1))  # waits for a free slot
    trace = []
    while s.busy:
        plan, admitted = s.plan()
        tokens, finished = s.commit(plan, [7] * len(plan["members"]))
        trace.append(([(m["id"], m["phase"], m["tokens"], m["emits"]) for m in plan["members"]],
                      admitted, [t[0] for t in tokens], finished))
    assert trace == [
        ([("a", "prefill", 4, False), ("b", "prefill", 1, True)], ["a", "b"], ["b"], ["b"]),
        ([("a", "prefill", 4, False), ("c", "prefill", 2, True)], ["c"], ["c"], ["c"]),
        ([("a", "prefill", 2, True)], [], ["a"], []),
        ([("a", "decode", 1, True)], [], ["a"], ["a"]),
    ]
    with pytest.raises(ValueError):
        s.add(Seq("d", [], max_tokens=1))


def test_wire_frames_split_anywhere_and_bad_frames_are_errors():
    from samples.batching import wire

    msgs = [{"id": "cmpl-1", "prompt_ids": [1, 2], "max_tokens": 3}, {"step": 1, "tokens": []}]
    data = b"".join(wire.encode(m) for m in msgs)
    for cut in range(len(data) + 1):
        r = wire.FrameReader()
        assert r.feed(data[:cut]) + r.feed(data[cut:]) == msgs
    with pytest.raises(wire.ProtocolError, match="not JSON"):
        wire.FrameReader().feed(wire.HEADER.pack(3) + b"{x}")
    with pytest.raises(wire.ProtocolError, match="not a JSON object"):
        wire.FrameReader().feed(wire.HEADER.pack(2) + b"[]")
    with pytest.raises(wire.ProtocolError, match="over the"):
        wire.FrameReader().feed(wire.HEADER.pack(wire.MAX_FRAME + 1))


@pytest.mark.parametrize("argv, message", [
    (["--layout", "tp2", "--libcuda", "x"], "needs both"),
    (["--device", "cuda", "--libcuda", "x"], "stand-ins"),
    (["--layout", "thread", "--libnccl", "x"], "tp2"),
    (["--max-batch", "0"], "at least 1"),
])
def test_server_rejects_inconsistent_options(argv, message, capsys):
    from samples.batching.server import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_engine_process_killed_requests_get_503_not_a_hang(tmp_path):
    import os
    import signal

    server = SampleServer("samples.batching.server", port=free_port(),
                          args=["--layout", "process", "--truth", str(tmp_path / "t.jsonl")],
                          log=tmp_path / "server.log")
    with server:
        url = server.base_url + "/v1/completions"
        status, doc = _post(url, {"model": "tiny-gpt", "prompt": "a b c", "max_tokens": 2})
        assert status == 200 and doc["usage"]["completion_tokens"] == 2
        engine = {r["pid"] for r in truthfile.read(tmp_path / "t.jsonl") if r["type"] == "step"}
        assert len(engine) == 1 and _parent(next(iter(engine))) == server.pid
        os.kill(engine.pop(), signal.SIGKILL)
        status, doc = _post(url, {"model": "tiny-gpt", "prompt": "a b c", "max_tokens": 2})
        assert status == 503 and "engine" in doc["error"]["message"]
        assert server.proc.poll() is None  # the API process goes on answering
    assert "the engine closed its socket" in (tmp_path / "server.log").read_text()
