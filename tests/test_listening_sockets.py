"""The listening TCP sockets the agent looks for every second (the netwait port filter,
--port): from sock_diag in its own network namespace, from /proc/PID/net/tcp in
another, TIME_WAIT rows skipped before they are parsed."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from tracer.probes import procfs, sockdiag


def _inode(s: socket.socket) -> int:
    return os.fstat(s.fileno()).st_ino


def test_sock_diag_and_proc_agree_on_listeners_and_skip_connections() -> None:
    v4, v6 = socket.socket(), socket.socket(socket.AF_INET6)
    v4.bind(("127.0.0.1", 0))
    v6.bind(("::1", 0))
    v4.listen()
    v6.listen()
    conn = socket.create_connection(v4.getsockname())
    peer, _ = v4.accept()
    try:
        want = {_inode(v4): v4.getsockname()[1], _inode(v6): v6.getsockname()[1]}
        diag = sockdiag.tcp_listening()
        assert diag is not None
        rows = procfs.inet_sockets(os.getpid(), listening=True)
        proc = {i: e.local_port for i, e in rows.items()}
        for got in (diag, proc):
            assert {i: got.get(i) for i in want} == want
            assert _inode(conn) not in got and _inode(peer) not in got
        every = procfs.inet_sockets(os.getpid())
        assert _inode(conn) in every and every[_inode(conn)].state == 1  # ESTABLISHED
    finally:
        for s in (conn, peer, v4, v6):
            s.close()


def test_time_wait_rows_are_skipped_when_only_listeners_are_asked_for() -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    for _ in range(200):  # the client closes first: its end waits in TIME_WAIT
        c = socket.create_connection(srv.getsockname())
        a, _ = srv.accept()
        c.close()
        a.close()
    try:
        table = open(f"/proc/{os.getpid()}/net/tcp").read().splitlines()[1:]
        rows = [line.split() for line in table]
        assert sum(1 for r in rows if r[3] == "06") >= 200  # TIME_WAIT rows are there
        got = procfs.inet_sockets(os.getpid(), listening=True)
        assert {e.state for e in got.values()} == {procfs.TCP_LISTEN}
        assert got[_inode(srv)].local_port == srv.getsockname()[1]
    finally:
        srv.close()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a network namespace of its own needs root and unshare(1)")
def test_a_process_in_another_namespace_is_read_from_its_proc_table() -> None:
    code = ("import socket,sys,time; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen();"
            "print(s.getsockname()[1], flush=True); time.sleep(30)")
    child = subprocess.Popen(["unshare", "--net", sys.executable, "-c", code],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        assert procfs.netns(child.pid) != procfs.netns(os.getpid())
        theirs = procfs.inet_sockets(child.pid, listening=True)
        assert [e.local_port for e in theirs.values()] == [port]
        ours = sockdiag.tcp_listening()  # the agent's namespace: not that socket
        assert ours is not None and set(ours) & set(theirs) == set()
    finally:
        child.kill()
        child.wait()


def test_unix_socketpair_ends_are_each_others_peers() -> None:
    a, b = socket.socketpair()
    try:
        peers = sockdiag.unix_peers()
        assert peers[_inode(a)] == _inode(b) and peers[_inode(b)] == _inode(a)
    finally:
        a.close()
        b.close()
