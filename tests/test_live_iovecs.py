"""A vectored write's buffers share DATA records (bpf/sockets.c ``copy_step``), on a
real process: gRPC's sendmsg hands the kernel a frame header and a message per iovec,
five a call, and each iovec used to be a record of its own. The records of a syscall
hold its bytes in order, whatever the iovecs' sizes; a call with more iovecs than the
probe reads is cut at a marker, counted."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

from tests.live import traced
from tracer.events import capture, schema
from tracer.events.wire import CONSTANTS as C

pytestmark = pytest.mark.bpf

CHUNK = C["CHUNK"]
MAX_IOV = C["MAX_IOV"]

# Each sendmsg's iovecs: distinct bytes per buffer, so a byte out of place shows.
CALLS = [
    [9, 5, 41, 9, 5, 73],  # a gRPC-sized call: frame header, message prefix, message...
    [100, 20_000, 50],  # a piece past half a record, then one past a whole record
    [CHUNK, 3],  # a whole record's worth, then a little
    [10] * (MAX_IOV + 8),  # more iovecs than the probe reads: cut after MAX_IOV
]

CHILD = textwrap.dedent("""
    import socket, sys
    calls = [[int(n) for n in c.split(",")] for c in sys.argv[1:]]
    print("ready", flush=True)
    sys.stdin.readline()
    ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen()
    a = socket.create_connection(ls.getsockname()); b, _ = ls.accept()
    total = 0
    for i, sizes in enumerate(calls):
        bufs = [bytes([65 + (i * 7 + j) % 58]) * n for j, n in enumerate(sizes)]
        sent = a.sendmsg(bufs)
        assert sent == sum(sizes), sent
        total += sent
        got = 0
        while got < sent:  # read it all before the next call: one call, one segment run
            got += len(b.recv(1 << 20))
    print("done", total, flush=True)
    sys.stdin.readline()
""")


def _expected(i: int, sizes: list[int]) -> bytes:
    return b"".join(bytes([65 + (i * 7 + j) % 58]) * n for j, n in enumerate(sizes))


def _sendmsg_records(path: Path, pid: int) -> list[list[schema.DataEvent]]:
    """Per outbound sendmsg of ``pid``, in order, its DATA records."""
    calls: dict[tuple[int, int], list[schema.DataEvent]] = defaultdict(list)
    for item in capture.CaptureReader(path):
        if isinstance(item, bytes):
            ev = schema.decode(item)
            if (isinstance(ev, schema.DataEvent) and ev.pid == pid and not ev.inbound
                    and ev.syscall == C["SYS_SENDMSG"]):
                calls[(ev.ts_exit, ev.tid)].append(ev)
    return [calls[k] for k in sorted(calls)]


def test_the_iovecs_of_a_sendmsg_share_records_and_keep_their_order(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, *(",".join(map(str, c)) for c in CALLS)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        rec = tmp_path / "iov.ttcap"
        with traced(pids=[child.pid], record=str(rec)) as got:
            child.stdin.write("go\n")
            child.stdin.flush()
            line = child.stdout.readline().split()
            assert line[0] == "done", line
        calls = _sendmsg_records(rec, child.pid)
    finally:
        child.kill()
        child.wait()
    assert len(calls) == len(CALLS), [len(c) for c in calls]
    for i, (sizes, records) in enumerate(zip(CALLS, calls)):
        want = _expected(i, sizes)
        assert all(r.ret == len(want) for r in records)
        # records tile the syscall's bytes from 0, in order, each at its offset
        pos = 0
        for r in records:
            assert r.offset == pos, (i, [(x.offset, len(x.payload)) for x in records])
            pos += len(r.payload)
        data = b"".join(r.payload for r in records)
        cut = len(sizes) > MAX_IOV
        if cut:
            assert data == want[: sum(sizes[:MAX_IOV])]
            assert records[-1].truncated and records[-1].last and not records[-1].payload
        else:
            assert data == want
            assert records[-1].last and not any(r.truncated for r in records)
        assert not any(r.last for r in records[:-1])
        assert all(len(r.payload) <= CHUNK for r in records)
    # the gRPC-sized call is one record, not one an iovec
    assert len(calls[0]) == 1
    # 100 bytes, then the 20,000-byte buffer: half a record's piece fills the first
    # record past half (8,292 bytes), the rest of the buffer is the second, 50 the third
    assert [len(r.payload) for r in calls[1]] == [100 + CHUNK // 2, 20_000 - CHUNK // 2, 50]
    assert [len(r.payload) for r in calls[2]] == [CHUNK, 3]
    assert [len(r.payload) for r in calls[3]] == [10 * MAX_IOV, 0]
    assert got.report["capture.iov_cut"] >= 1
