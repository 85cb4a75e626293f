"""Pausing a running `tokentrace run` (issue 16): `--control` and SIGUSR1/SIGUSR2 take
every probe out and put it back while the agent keeps running, on a real server with a
real client: nothing of the paused stretch is captured, and what comes after the
resume is traced again, on new connections and on keep-alive ones opened before."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time

import pytest

from samples.launch import SampleServer
from tests.conftest import free_port
from tests.live import traced_cli
from tracer.control import send
from tracer.probes.bpfstats import ProgramCost, parse_costs

pytestmark = pytest.mark.bpf


def chat(conn: http.client.HTTPConnection, max_tokens: int) -> None:
    body = json.dumps({"model": "m", "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "hi"}]})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and b"[DONE]" in r.read()


def wait_status(sock: str, word: str) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        reply = send(sock, "status")
        if reply.startswith(f"ok {word}"):
            return reply
        time.sleep(0.05)
    raise AssertionError(f"never {word}: {reply}")


def test_pause_and_resume_a_running_agent(tmp_path):
    port = free_port()
    sock = str(tmp_path / "ctl.sock")
    with SampleServer("samples.stdlib_server", port=port, health="/") as server, \
            traced_cli(["--pid", str(server.pid), "--control", sock],
                       str(tmp_path / "spans.jsonl")) as run:
        assert oct(os.stat(sock).st_mode & 0o777) == "0o600"
        kept = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for _ in range(3):
            chat(kept, 3)  # traced
        reply = send(sock, "pause")
        assert reply.startswith("ok paused"), reply
        other = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for c in (kept, other, kept):
            chat(c, 5)  # while paused: not traced
        other.close()
        os.kill(run.pid, signal.SIGUSR2)  # resume, as a user without --control would
        wait_status(sock, "tracing")
        late = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        # traced again, but for kept's first: its server thread was already waiting in a
        # read when the probes came back (as at attach, that read's bytes are not seen);
        # the keep-alive connection is followed from its next request on
        for c in (kept, late, kept, late, kept):
            chat(c, 7)
        os.kill(run.pid, signal.SIGUSR1)
        assert wait_status(sock, "paused")
        chat(late, 5)
        assert send(sock, "bogus").startswith("error: unknown command")
        kept.close()
        late.close()
    assert run.returncode == 0, run.stderr
    tokens = [s["attributes"].get("gen_ai.request.max_tokens") for s in run.spans]
    assert sorted(tokens) == [3] * 3 + [7] * 4, (tokens, run.stderr)
    assert all(s["attributes"].get("gen_ai.usage.output_tokens") == t
               for s, t in zip(run.spans, tokens))
    assert not os.path.exists(sock)  # removed at exit


def test_probe_stats_count_the_programs_runs(tmp_path):
    """`probe-stats on` turns the kernel's per-program statistics on: the socket
    programs' runs grow with the requests served, their time with them; `off` ends it."""
    port = free_port()
    sock = str(tmp_path / "ctl.sock")
    with SampleServer("samples.stdlib_server", port=port, health="/") as server, \
            traced_cli(["--pid", str(server.pid), "--control", sock],
                       str(tmp_path / "spans.jsonl")) as run:
        assert send(sock, "probe-stats").startswith("error: probe-stats is off")
        assert send(sock, "probe-stats on") == "ok probe-stats on"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        chat(conn, 2)
        before = parse_costs(send(sock, "probe-stats").removeprefix("ok probe-stats"))
        for _ in range(5):
            chat(conn, 4)
        after = parse_costs(send(sock, "probe-stats").removeprefix("ok probe-stats"))
        conn.close()
        assert send(sock, "probe-stats off") == "ok probe-stats off"
        assert send(sock, "probe-stats").startswith("error: probe-stats is off")

        def runs(costs, word):
            return sum(c.runs for n, c in costs.items() if word in n)

        # each request is read (at least once) and its 4 tokens and [DONE] written
        assert runs(after, "sys_exit_") - runs(before, "sys_exit_") >= 5 * 2, (before, after)
        grown = [n for n in after if after[n].runs > before.get(n, ProgramCost(0, 0)).runs]
        assert grown and all(after[n].run_ns > before.get(n, ProgramCost(0, 0)).run_ns
                             for n in grown)
    assert run.returncode == 0, run.stderr
