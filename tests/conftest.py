"""Shared helpers. Tests with real probes need root, BCC and kernel headers (`make test`
sets the machine up); they are never skipped: if the machine cannot trace, they fail
and say why."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CAPTURES = ROOT / "samples" / "captures"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def capture_streams(path: Path) -> dict[tuple[int, int, int], list[tuple[bool, int, bytes]]]:
    """Per connection, the (inbound, ts, bytes) chunks a capture holds, in order."""
    from tracer.events import capture, schema

    out: dict[tuple[int, int, int], list[tuple[bool, int, bytes]]] = {}
    for item in capture.CaptureReader(path):
        if isinstance(item, bytes):
            ev = schema.decode(item)
            if isinstance(ev, schema.DataEvent) and ev.payload:
                out.setdefault(ev.key, []).append((ev.inbound, ev.ts_exit, ev.payload))
    return out


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of a ``test_live_*`` module runs real probes: mark it ``bpf`` (so
    ``-m bpf`` / ``-m "not bpf"`` select exactly the live tests), whether or not the
    module says so itself."""
    for item in items:
        if item.path.name.startswith("test_live_"):
            item.add_marker(pytest.mark.bpf)


@pytest.fixture
def openai_capture() -> Path:
    return CAPTURES / "openai-http1.ttcap"
