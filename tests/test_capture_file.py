"""Capture files: round trip, truncation, wrong files and versions."""

import gzip
import json

import pytest

from tracer.events import capture, schema
from tracer.pipeline import Pipeline


def test_round_trip_of_wire_and_user_items(tmp_path, openai_capture):
    items = list(capture.CaptureReader(openai_capture))
    assert any(isinstance(i, bytes) for i in items)
    assert any(isinstance(i, schema.ProcessInfo) for i in items)
    out = tmp_path / "copy.ttcap"
    w = capture.CaptureWriter(out, keep_secrets=True)  # byte for byte
    for i in items:
        w.write(i)
    w.close()
    again = list(capture.CaptureReader(out))
    assert again == items


def test_truncated_capture_keeps_what_was_written(tmp_path, openai_capture):
    raw = gzip.decompress(openai_capture.read_bytes())
    cut = tmp_path / "cut.ttcap"
    cut.write_bytes(gzip.compress(raw[: len(raw) // 2]))
    r = capture.CaptureReader(cut)
    items = list(r)
    assert r.truncated and items
    p = Pipeline([])
    for i in items:
        p.feed(i)
    p.close()  # analysing a cut capture is fine, nothing raises


def test_not_a_capture(tmp_path):
    f = tmp_path / "x.ttcap"
    f.write_bytes(b"hello world")
    with pytest.raises(capture.CaptureError, match="not a tokentrace capture"):
        capture.CaptureReader(f)


def test_unknown_wire_version_is_refused(tmp_path):
    h = capture.new_header()
    h["wire_version"] = 999
    f = tmp_path / "v.ttcap"
    f.write_bytes(gzip.compress(json.dumps(h).encode() + b"\n"))
    with pytest.raises(capture.CaptureError, match="wire_version 999"):
        capture.CaptureReader(f)
