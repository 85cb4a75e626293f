"""Conservation: for every GPU process and quantity, what is charged to requests plus
what is left unattributed equals what was observed, exactly (to float rounding), on
random streams and on every recorded capture.

"Observed" here is counted independently of the correlator: by summing the bursts fed
in (property test) or by the GPU ledger's per-process totals (captures).
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.openai import LLMResponse
from samples.scoring import replay
from tests.conftest import CAPTURES
from tracer.correlate.attribution import GpuAttribution
from tracer.correlate.ipc import IpcGraph
from tracer.correlate.records import RequestRecord
from tracer.correlate.work import QUANTITIES
from tracer.events.gpu import KernelBurst

API, ENGINE_PID = 1, 2


def kburst(pid: int, tid: int, first: int, last: int, launches: int, d2h: bool,
           h2d_bytes: int, memset: int, sync: bool = True) -> KernelBurst:
    return KernelBurst(pid=pid, tid=tid, reason="sync" if sync else "interval", sync_api=0,
                       first_ts=first, last_ts=last, launches=launches,
                       graph_launches=launches // 7,
                       copy_bytes={"h2d": h2d_bytes, "d2h": 4 if d2h else 0, "d2d": 0,
                                   "other": 0},
                       copy_calls={"h2d": 1 if h2d_bytes else 0, "d2h": 1 if d2h else 0},
                       memset_bytes=memset, memset_calls=1 if memset else 0,
                       sync_calls=1 if sync else 0, sync_wait_ns=(last - first) // 3,
                       query_polls=0, handle_counts={})


@st.composite
def streams(draw):
    """An engine (in the API process or its own) running steps of 1-3 bursts, and
    requests arriving at random, each in a random run of steps, streamed (tokens after
    its steps, some late), whole (usage only) or not an LLM request at all."""
    n_steps = draw(st.integers(1, 40))
    engine_pid = draw(st.sampled_from([API, ENGINE_PID]))
    bursts = []
    t = 1000
    step_ends = []
    for _ in range(n_steps):
        parts = draw(st.integers(1, 3))
        for p in range(parts):
            last = p == parts - 1
            dur = draw(st.integers(5, 60))
            bursts.append(kburst(engine_pid, 50, t, t + dur, draw(st.integers(0, 40)),
                                 d2h=last, h2d_bytes=draw(st.sampled_from([0, 64, 4096])),
                                 memset=draw(st.sampled_from([0, 128])),
                                 sync=last or draw(st.booleans())))
            t += dur + draw(st.integers(1, 20))
        step_ends.append(t - 1)
        t += 5
    records = []
    for fd in range(draw(st.integers(0, 8))):
        first = draw(st.integers(0, n_steps - 1))
        last = draw(st.integers(first, min(n_steps - 1, first + 12)))
        arrival = step_ends[first - 1] if first else 0
        arrival -= draw(st.integers(0, 50))
        kind = draw(st.sampled_from(["stream", "whole", "plain"]))
        toks = [step_ends[k] + draw(st.integers(1, 40)) for k in range(first, last + 1)]
        toks.sort()
        r = None
        if kind == "stream":
            r = LLMResponse(status=200, streamed=True, output_tokens=len(toks),
                            first_token_ts=toks[0], token_ts=toks)
        elif kind == "whole":
            r = LLMResponse(status=200, output_tokens=len(toks))
        rec = RequestRecord(pid=API, fd=10 + fd, conn_id=10 + fd, exchange=0, role="server",
                            tids=[API], start_ns=max(0, arrival),
                            request_end_ns=max(0, arrival), response_start_ns=toks[-1],
                            end_ns=toks[-1] + 1, llm_response=r)
        records.append(rec)
    # a same-thread burst now and then: the API thread's own GPU work during a request
    same = []
    for rec in records:
        if draw(st.booleans()):
            mid = (rec.start_ns + rec.end_ns) // 2
            same.append(kburst(API, API, mid, mid + 1, draw(st.integers(1, 9)), d2h=False,
                               h2d_bytes=0, memset=0))
    return engine_pid, sorted(bursts + same, key=lambda b: b.last_ts), records


def run(engine_pid, bursts, records):
    stats: Counter[str] = Counter()
    ipc = IpcGraph(stats)
    if engine_pid != API:
        ipc.link(API, engine_pid, "test")
    out: list[RequestRecord] = []
    open_recs = list(records)
    a = GpuAttribution(out.append, lambda pid: [r for r in open_recs if r.pid == pid],
                       stats, hold_ns=100, ipc=ipc)
    # stream order: bursts and request ends interleaved by time
    events = [(b.last_ts, 0, b) for b in bursts] + [(r.end_ns, 1, r) for r in records]
    for ts, kind, ev in sorted(events, key=lambda e: (e[0], e[1])):
        if kind == 0:
            a.burst(ev)
        else:
            open_recs.remove(ev)
            a.finished(ev)
        a.advance(ts)
    a.close()
    return a, out, stats


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_charged_plus_unattributed_equals_observed(stream):
    engine_pid, bursts, records = stream
    a, out, _ = run(engine_pid, bursts, records)
    assert len(out) == len(records)  # every record is released, once
    assert a.ledger.balanced(), a.ledger.reconciliation()
    # observed, counted here from the bursts themselves
    for pid in {b.pid for b in bursts}:
        mine = [b for b in bursts if b.pid == pid]
        obs = a.ledger.observed[pid]
        assert obs.get("kernel_launches", 0) == sum(b.launches for b in mine)
        assert obs.get("memcpy_bytes.h2d", 0) == sum(b.copy_bytes["h2d"] for b in mine)
        assert obs.get("memset_bytes", 0) == sum(b.memset_bytes for b in mine)
        left = sum(w.get("kernel_launches", 0) for w in a.ledger.unattributed[pid].values())
        charged = a.ledger.charged[pid].get("kernel_launches", 0)
        assert math.isclose(charged + left, obs.get("kernel_launches", 0), abs_tol=1e-6)
    # what the records carry adds up to what was charged (attributes are rounded)
    charged = sum(a.ledger.charged[p].get("kernel_launches", 0) for p in a.ledger.charged)
    carried = sum(r.gpu.get("gpu.kernel_launches", 0) for r in out)
    assert carried == pytest.approx(charged, abs=1e-3 * max(1, len(out)))
    time = sum(a.ledger.charged[p].get("gpu_time_ns", 0) for p in a.ledger.charged)
    assert sum(r.gpu.get("gpu.time_ms", 0) for r in out) == pytest.approx(
        time / 1e6, abs=1e-4 * max(1, len(out)))


def capture_files() -> list[Path]:
    return sorted(CAPTURES.rglob("*.ttcap"))


def test_every_capture_is_found():
    names = {p.name for p in capture_files()}
    assert {"hf-serve-cb-h100.ttcap", "hf-cb-c32-h100.ttcap", "torch-h200.ttcap",
            "openai-http1.ttcap", "gpu-standin.ttcap", "verbs-standin.ttcap"} <= names, names


@pytest.mark.parametrize("path", capture_files(), ids=lambda p: p.name)
def test_every_capture_replays_conserved(path: Path):
    """Every recorded capture: the correlator's books balance for every process and
    quantity, and what it observed is what the GPU ledger counted on its own (in a
    capture whose launch probes were sampled: what the GPU summary reports, the steps'
    estimates, never fewer than the probes saw)."""
    _, pipeline = replay(str(path))
    recon = pipeline.reconciliation()
    assert recon["balanced"], recon
    ledger = pipeline.attribution.ledger
    gpu = pipeline.gpu.summary()
    summary = {p["pid"]: p for p in gpu["processes"]}
    for pid, p in pipeline.gpu.processes.items():
        launches = sum(t.kernel_launches for t in p.threads.values())
        observed = ledger.observed[pid].get("kernel_launches", 0)
        if "launch_sampling" in gpu:
            assert observed == summary[pid]["kernel_launches"] >= launches
        else:
            assert observed == launches
        for q in QUANTITIES:
            row = recon["processes"].get(str(pid), {}).get(q)  # no row: nothing observed
            if row:
                assert row["observed"] == pytest.approx(row["charged"] + row["unattributed"],
                                                        rel=1e-9, abs=1e-6)
    # per-request GPU time never sums past the busy time, nor busy past the window
    for row in recon["cost"]["processes"]:
        assert row["charged_s"] <= row["busy_s"] + 1e-9
        assert row["busy_s"] <= row["window_s"] + 1e-9 or row["window_s"] == 0
