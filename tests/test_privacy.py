"""Secrets the tracer sees and must not keep: prompts unless asked, credential headers
and command-line keys in captures, spans and files, the tenant salt, metrics labels."""

from __future__ import annotations

import gzip
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tracer.correlate.connections import TrackerOptions
from tracer.events import capture, schema, wire
from tracer.export.metrics import OTHER, LabelCap, PrometheusSink, _listen
from tracer.pipeline import Pipeline
from tracer.privacy import REDACTED, redact_args

C = wire.CONSTANTS
KEY = b"sk-live-0123456789abcdefSECRET"
BODY = json.dumps({"model": "tiny", "max_tokens": 2,
                   "messages": [{"role": "user", "content": "hello"}]}).encode()
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY +
           b"\r\nCookie: session=COOKIESECRET\r\nx-api-key: XKEYSECRET\r\n"
           b"Content-Length: %d\r\n\r\n" % len(BODY)) + BODY
RESPONSE = (b"HTTP/1.1 200 OK\r\nSet-Cookie: sid=SETCOOKIESECRET\r\n"
            b"content-type: application/json\r\ncontent-length: 48\r\n\r\n"
            b'{"choices": [{"message": {"content": "hi"}}]}\r\n\r\n'[:48])
SECRETS = (KEY, b"COOKIESECRET", b"XKEYSECRET", b"SETCOOKIESECRET")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracer", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def conn(op: int, ts: int) -> bytes:
    f = dict(kind=C["KIND_CONN"], pid=10, tid=10, fd=5, ts=ts, conn_id=99, ret=0,
             listen_fd=3, op=op, role=C["ROLE_SERVER"], family=2, port=5555,
             addr=bytes([127, 0, 0, 1]) + bytes(12))
    return wire.CONN.header.pack(*(f[n] for n in wire.CONN.names))


def data(payload: bytes, inbound: bool, ts: int, stream_off: int) -> bytes:
    f = dict(kind=C["KIND_DATA"], pid=10, tid=11, fd=5, conn_id=99, ts_enter=ts - 5,
             ts_exit=ts, ret=len(payload), offset=0, len=len(payload),
             syscall=C["SYS_RECVFROM"], direction=C["DIR_IN"] if inbound else C["DIR_OUT"],
             flags=C["FLAG_LAST"], pad=0, stream_off=stream_off)
    return wire.DATA.header.pack(*(f[n] for n in wire.DATA.names)) + payload


def exchange(cut: int | None = None) -> list[bytes]:
    """One request and response as ring-buffer records; the request split at ``cut``."""
    parts = [REQUEST] if cut is None else [REQUEST[:cut], REQUEST[cut:]]
    recs, off = [conn(C["CONN_ACCEPT"], 1)], 0
    for i, p in enumerate(parts):
        recs.append(data(p, True, 10 + i, off))
        off += len(p)
    recs += [data(RESPONSE, False, 20, 0), conn(C["CONN_CLOSE"], 30)]
    return recs


def analyse(items: list, options: TrackerOptions) -> list:
    records: list = []

    class Sink:
        def on_record(self, rec):
            records.append(rec)

        def close(self):
            pass

    p = Pipeline([Sink()], options=options)
    for i in items:
        p.feed(i)
    p.close()
    return records


# ---- captures --------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [None, 20, 50, 60, 65, 80, 100, 110, 130])
def test_capture_masks_credentials_same_length_and_replay_finds_the_live_tenant(tmp_path, cut):
    """``cut`` splits the request between two reads: inside a header name, at the colon,
    inside a key."""
    recs = exchange(cut)
    header = capture.new_header(tenant_salt="deployment-a")
    salt = capture.tenant_salt(header)
    live = analyse(recs, TrackerOptions(tenant_salt=salt))
    path = tmp_path / "c.ttcap"
    w = capture.CaptureWriter(path, header)
    for r in recs:
        w.write(r)
    w.write(schema.ProcessInfo(10, 1, "python", "/usr/bin/python",
                               ("python", "serve.py", "--api-key", "sk-cmdline-secret")))
    w.close()
    raw = gzip.decompress(path.read_bytes())
    for s in SECRETS + (b"sk-cmdline-secret",):
        assert s not in raw
    reader = capture.CaptureReader(path)
    items = list(reader)
    assert reader.header["secrets_masked"] is True
    stored = [i for i in items if isinstance(i, bytes)]
    assert [len(i) for i in stored] == [len(r) for r in recs]  # same length
    assert items[-1].cmdline == ("python", "serve.py", "--api-key", REDACTED)
    again = analyse(items, TrackerOptions(tenant_salt=capture.tenant_salt(reader.header),
                                          secrets_masked=True))
    assert len(live) == len(again) == 1
    assert live[0].tenant and again[0].llm_request.model == "tiny"
    key_split = cut is not None and 60 <= cut < 97  # its value was cut in two
    assert again[0].tenant == (None if key_split else live[0].tenant)


def test_capture_secrets_keeps_credentials_and_salt_changes_tenants(tmp_path):
    recs = exchange()
    path = tmp_path / "c.ttcap"
    w = capture.CaptureWriter(path, capture.new_header(), keep_secrets=True)
    for r in recs:
        w.write(r)
    w.close()
    assert KEY in gzip.decompress(path.read_bytes())
    reader = capture.CaptureReader(path)
    items = list(reader)
    assert reader.header["secrets_masked"] is False
    tenants = {analyse(items, TrackerOptions(tenant_salt=s))[0].tenant
               for s in (b"a", b"b", capture.tenant_salt(reader.header))}
    assert len(tenants) == 3  # per-deployment salts: tenants unlinkable across them
    # a capture from before salts replays with the old fixed salt, as it always did
    old = analyse(items, TrackerOptions())[0].tenant
    import hashlib
    assert old == hashlib.sha256(b"tokentrace-tenant-v1" + KEY).hexdigest()[:16]


def test_masker_state_is_bounded_and_dropped_at_close():
    m = capture.SecretMasker(b"s", max_streams=8)
    for fd in range(100):
        f = dict(kind=C["KIND_DATA"], pid=1, tid=1, fd=fd, conn_id=1, ts_enter=1, ts_exit=2,
                 ret=20, offset=0, len=20, syscall=C["SYS_READ"], direction=C["DIR_IN"],
                 flags=C["FLAG_LAST"], pad=0, stream_off=0)
        m.record(wire.DATA.header.pack(*(f[n] for n in wire.DATA.names))
                 + b"GET / HTTP/1.1\r\nAuth")
    assert len(m._state) == 8


# ---- files ------------------------------------------------------------------------------


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_every_file_written_is_0600(tmp_path, openai_capture):
    old = os.umask(0o022)
    try:
        pre = tmp_path / "spans.jsonl"
        pre.write_text("old")
        pre.chmod(0o644)  # an existing world-readable file is made private too
        w = capture.CaptureWriter(tmp_path / "c.ttcap")
        w.close()
        assert mode(tmp_path / "c.ttcap") == 0o600
    finally:
        os.umask(old)
    r = cli("replay", str(openai_capture), "--quiet", "--jsonl", str(pre),
            "--summary", str(tmp_path / "summary.json"))
    assert r.returncode == 0, r.stderr
    assert mode(pre) == mode(tmp_path / "summary.json") == 0o600
    r = cli("report", str(pre), "-o", str(tmp_path / "report"))
    assert r.returncode == 0, r.stderr
    files = [p for p in (tmp_path / "report").rglob("*") if p.is_file()]
    assert files and all(mode(p) == 0o600 for p in files)


# ---- spans ------------------------------------------------------------------------------


def test_prompts_completions_and_cmdline_only_when_asked(tmp_path, openai_capture):
    """The real opt-in path: replay a capture with and without the switches."""
    plain, asked = tmp_path / "plain.jsonl", tmp_path / "asked.jsonl"
    assert cli("replay", str(openai_capture), "--quiet", "--jsonl", str(plain)).returncode == 0
    assert cli("replay", str(openai_capture), "--quiet", "--jsonl", str(asked),
               "--capture-content", "--capture-cmdline").returncode == 0
    p = [json.loads(line) for line in plain.read_text().splitlines()]
    a = [json.loads(line) for line in asked.read_text().splitlines()]
    assert len(p) == len(a) >= 2
    for s in p:
        assert not {"tokentrace.prompt.text", "tokentrace.completion.text"} & set(s["attributes"])
        assert "process.command_line" not in s["resource"]
    llm = [s for s in a if "gen_ai.request.model" in s["attributes"]]
    assert llm and all("tokentrace.prompt.text" in s["attributes"] for s in llm)
    assert any(s["attributes"].get("tokentrace.completion.text") for s in llm)
    assert all("process.command_line" in s["resource"] for s in a)


def test_redact_args_hides_keys_not_the_rest():
    args = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/Llama-3-8B",
            "--api-key", "abc", "--hf-token=hf_x", "OPENAI_API_KEY=xyz", "--token-rate", "50",
            "--tokenizer", "gpt2", "--max-num-batched-tokens", "8192",
            "sk-proj-abcdefgh12345", "AWS_SECRET_ACCESS_KEY=abc", "--ssl-keyfile", "/k.pem",
            "deadbeefdeadbeefdeadbeefdeadbeef12"]
    assert redact_args(args) == [
        "python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/Llama-3-8B",
        "--api-key", REDACTED, f"--hf-token={REDACTED}", f"OPENAI_API_KEY={REDACTED}",
        "--token-rate", "50", "--tokenizer", "gpt2", "--max-num-batched-tokens", "8192",
        REDACTED, f"AWS_SECRET_ACCESS_KEY={REDACTED}", "--ssl-keyfile", "/k.pem", REDACTED]


# ---- metrics ----------------------------------------------------------------------------


def test_prometheus_listens_on_loopback_unless_told():
    assert _listen("9464") == ("127.0.0.1", 9464)
    assert _listen("0.0.0.0:9464") == ("0.0.0.0", 9464)
    sink = PrometheusSink(0)
    try:
        assert sink._server.server_address[0] == "127.0.0.1"
    finally:
        sink.close()


def test_label_values_are_capped_and_counted():
    cap = LabelCap(3)
    assert [cap(f"m{i % 5}") for i in range(10)] == [
        "m0", "m1", "m2", OTHER, OTHER, "m0", "m1", "m2", OTHER, OTHER]
    assert cap.capped == 4
