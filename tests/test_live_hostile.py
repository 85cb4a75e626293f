"""Hostile traffic against a real server under `tokentrace run`: the tracer lives, says
nothing alarming, exports the good requests around the bad ones right, keeps no secret,
and its capture replays to the same spans."""

from __future__ import annotations

import gzip
import json
import os
import socket
import stat
import subprocess
import sys

import pytest

from samples.launch import SampleServer
from tests.conftest import free_port
from tests.live import TimedClient, traced_cli

pytestmark = pytest.mark.bpf

CHAT = "/v1/chat/completions"


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (path.encode(), extra, len(body))
            + body)


def chat_body(**fields) -> bytes:
    doc = {"model": "tiny-gpt", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(doc).encode()


HOSTILE = {
    "infinity": post(CHAT, chat_body(max_tokens=float("inf"), stream=True)),
    "nan_usage_knobs": post(CHAT, chat_body(max_tokens=2, temperature=float("nan"))
                            .replace(b"NaN", b"1e999")),
    "deep_nesting": post(CHAT, b'{"model": "tiny-gpt", "messages": '
                         + b"[" * 50_000 + b"]" * 50_000 + b"}"),
    "number_text_part": post(CHAT, json.dumps({"model": "tiny-gpt", "max_tokens": 2,
                                               "messages": [{"role": "user",
                                                             "content": [{"text": 5}]}]})
                             .encode()),
    "header_200kb": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000
                     + b"\r\nConnection: close\r\n\r\n"),
    "tls_on_plaintext": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(32)
                         + b"\x00\x00\x02\x13\x01\x01\x00" + os.urandom(400)),
}


def send_raw(port: int, data: bytes) -> bytes:
    """Send ``data`` on a new connection; what came back before the server closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(data)
        except OSError:
            pass  # the server may close before it read everything
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except OSError:
            pass
        return out


def spans_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_hostile_requests_between_good_ones(tmp_path):
    live, cap = tmp_path / "live.jsonl", tmp_path / "cap.ttcap"
    again, summary = tmp_path / "replay.jsonl", tmp_path / "summary.json"
    with SampleServer(port=free_port(), log=tmp_path / "server.log") as server:
        client = TimedClient(server.base_url)
        client.chat(stream=False, max_tokens=2)  # warm up
        good, answers = [], {}
        with traced_cli(["--pid", str(server.pid), "--record", str(cap),
                         "--summary", str(summary)], str(live)) as run:
            good.append(client.chat(stream=True, max_tokens=3))
            for i, (name, data) in enumerate(HOSTILE.items()):
                answers[name] = send_raw(server.port, data)
                good.append(client.chat(stream=i % 2 == 0, max_tokens=3 + i))
    # the server answered the bad requests as it does (400 for Infinity, 500 for what
    # broke its own parser) and the good ones normally
    assert answers["infinity"].startswith(b"HTTP/1.1 400")
    assert answers["deep_nesting"].startswith(b"HTTP/1.1 ")
    # the tracer lived, stopped cleanly, printed no traceback, no parser failed
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr and "Error" not in run.stderr, run.stderr
    report = json.loads(summary.read_text())["report"]
    assert not report.get("parser_errors"), report
    print("\n" + ", ".join(f"{k}={v}" for k, v in sorted(report.items())
                           if not k.startswith("capture.")))
    # the good requests are exported right
    spans = spans_of(live)
    by_id = {s["attributes"].get("gen_ai.response.id"): s for s in spans}
    for g in good:
        a = by_id[g["id"]]["attributes"]
        assert a["http.response.status_code"] == 200
        assert a["gen_ai.usage.output_tokens"] == g["output_tokens"]
        assert a["gen_ai.usage.input_tokens"] == g["input_tokens"]
        assert "tokentrace.request.incomplete" not in a
    # the bad ones are spans too, with nothing invented
    bad = [s["attributes"] for s in spans
           if s["attributes"].get("http.response.status_code") in (400, 500)]
    assert len(bad) >= 3
    (inf,) = [a for a in bad if a.get("tokentrace.request.stream")]  # max_tokens: Infinity
    assert inf["http.response.status_code"] == 400 and "gen_ai.request.max_tokens" not in inf
    assert "tokentrace.error.message" not in inf  # the server's error text: content only
    assert all(a.get("gen_ai.request.max_tokens", 2) == 2 for a in bad)
    # no secret: the client's API key is in no span and not in the capture; files 0600
    assert "sk-test" not in live.read_text()
    assert b"Bearer sk-test" not in gzip.decompress(cap.read_bytes())
    assert all("process.command_line" not in s["resource"] for s in spans)
    for f in (live, cap, summary):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    # and the capture replays to the same spans
    r = subprocess.run([sys.executable, "-m", "tracer", "replay", str(cap), "--quiet",
                        "--jsonl", str(again)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    norm = lambda ss: sorted(json.dumps(s, sort_keys=True) for s in ss)  # noqa: E731
    assert norm(spans_of(again)) == norm(spans)
