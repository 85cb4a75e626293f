"""`tokentrace run --duty-cycle` (issue 16's cheaper mode) on a real server with a real
client: the probes are in for the cycle's windows only; a request wholly inside a
window is traced whole and says the share, one wholly inside a pause is not seen,
one a window's end cuts is counted; a replay of the run's capture gives the same."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import threading
import time

import pytest

from samples.launch import SampleServer
from tests.conftest import free_port
from tests.live import spans_by_response_id, traced_cli
from tracer.control import send
from tracer.events import capture, schema

pytestmark = pytest.mark.bpf

CUT = "the duty cycle's window closed before the response completed"


def streamed(port: int, max_tokens: int) -> dict:
    """One streamed chat request on a new connection: its id and monotonic times."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    body = json.dumps({"model": "m", "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "hi"}]})
    t0 = time.monotonic_ns()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    data = conn.getresponse().read()
    t1 = time.monotonic_ns()
    conn.close()
    rid = re.search(rb'"id": ?"([^"]+)"', data)
    assert rid and b"[DONE]" in data, data[:200]
    return {"id": rid.group(1).decode(), "t0": t0, "t1": t1}


def stretches(switches: list) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """From a capture's switch records: the stretches surely traced (a resume done to
    the pause's start) and surely not (a pause done to the next resume's start). A
    pause takes a while (each tracepoint's detach waits out a grace period); what it
    overlaps is neither."""
    traced, untraced, opened, closed = [], [], None, None
    for s in switches:
        if s.paused:
            if opened is not None:
                traced.append((opened, s.ts - int(s.switch_s * 1e9)))
            opened, closed = None, s.ts
        else:
            if closed is not None:
                untraced.append((closed, s.ts - int(s.switch_s * 1e9)))
            opened, closed = s.ts, None
    return traced, untraced


def test_duty_cycle_traces_whole_requests_in_its_windows_only(tmp_path):
    port = free_port()
    cap, summary, sock = tmp_path / "run.ttcap", tmp_path / "s.json", str(tmp_path / "ctl")
    sent: list[dict] = []
    stop = threading.Event()

    def client() -> None:
        i = 0
        while not stop.is_set():
            sent.append(streamed(port, 2 + i % 4))
            i += 1
            time.sleep(0.01)  # the agent (--sched-idle) gets a CPU to switch with

    with SampleServer("samples.stdlib_server", port=port, health="/") as server, \
            traced_cli(["--pid", str(server.pid), "--duty-cycle", "0.4/4", "--record", str(cap),
                        "--summary", str(summary), "--control", sock],
                       str(tmp_path / "spans.jsonl")) as run:
        t = threading.Thread(target=client)
        t.start()
        time.sleep(8.8)  # three windows, the first two closed
        assert send(sock, "duty-cycle 0.01").startswith("error: the duty cycle's window")
        stop.set()
        t.join()
    assert run.returncode == 0, run.stderr
    assert "duty cycle: tracing 0.4 of every 4 s (1.6-s windows)" in run.stderr
    items = list(capture.CaptureReader(str(cap)))
    switches = [it for it in items if isinstance(it, schema.TracingPaused)]
    assert all(s.duty == 0.4 for s in switches), switches
    assert [s.paused for s in switches][:5] == [False, True, False, True, False], switches
    on, off = stretches(switches)
    assert len(on) >= 2 and len(off) >= 2, switches
    print("switches:", [(s.ts, s.paused, round(s.switch_s, 3)) for s in switches])

    spans = spans_by_response_id(run.spans)
    inside = [c for c in sent if any(a + 50e6 < c["t0"] and c["t1"] < b - 50e6 for a, b in on)]
    paused = [c for c in sent if any(a + 50e6 < c["t0"] and c["t1"] < b - 50e6 for a, b in off)]
    assert len(inside) >= 20 and len(paused) >= 10, (len(inside), len(paused), len(sent))
    for c in inside:  # traced whole, and says it is a sample
        a = spans[c["id"]]["attributes"]
        assert a["tokentrace.duty_cycle"] == 0.4 and "error.type" not in a, a
    assert not [c["id"] for c in paused if c["id"] in spans]
    cut = [s for s in run.spans if s.get("status_message") == CUT]
    report = json.loads(summary.read_text())["report"]
    assert report.get("requests_cut_by_duty_cycle", 0) == len(cut)
    assert report["duty_cycle_pauses"] == sum(s.paused for s in switches)
    assert report.get("requests_cut_by_pause", 0) == 0

    out = tmp_path / "replay.jsonl"  # replay equals live, labels and cuts included
    subprocess.run([sys.executable, "-m", "tracer", "replay", str(cap), "--jsonl", str(out),
                    "--quiet"], check=True, capture_output=True, timeout=120)
    replayed = [json.loads(line) for line in out.read_text().splitlines()]
    view = lambda ss: sorted((s["attributes"].get("gen_ai.response.id", ""),  # noqa: E731
                              s["attributes"].get("tokentrace.duty_cycle"),
                              s.get("status_message")) for s in ss)
    assert view(replayed) == view(run.spans)
