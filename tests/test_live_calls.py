"""The socket probes' call in flight (bpf/sockets.c ``io_call``), on a real process:
each thread's data syscall is held from its entry to its exit, in the thread's own
task-local storage where the kernel has it (Linux 5.12+, BTF: here) or in a hash map.
A pause can miss either half of a call, and a task-storage slot is never emptied from
user space: the resume's epoch is what keeps a call entered before it from being taken
at an exit after it, with another syscall's return."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import capture_streams
from tests.live import traced

pytestmark = pytest.mark.bpf

# A process with a TCP connection to itself, driven by lines on stdin: "send WORD" sends
# WORD on one end; "recv" has the worker thread wait in recv() on the other end and say
# what came; "recv+file" the same, and right after the recv() (no syscall between) it
# reads FILE (a plain file: no socket the probes know).
CHILD = textwrap.dedent("""
    import os, queue, socket, sys, threading
    ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen()
    a = socket.create_connection(ls.getsockname()); b, _ = ls.accept()
    todo = queue.Queue()
    def worker():
        while True:
            job = todo.get()
            got = b.recv(100).decode()
            if job == "recv+file":
                fd = os.open(sys.argv[1], os.O_RDONLY)
                got += " " + os.read(fd, 100).decode()
                os.close(fd)
            print("got", got, flush=True)
    threading.Thread(target=worker, daemon=True).start()
    print("ready", flush=True)
    for line in sys.stdin:
        word = line.split()
        if word[0] == "send":
            a.sendall(word[1].encode())
        else:
            todo.put(word[0])
""")


def _say(p: subprocess.Popen, line: str) -> None:
    p.stdin.write(line + "\n")
    p.stdin.flush()


def _inbound(capture: Path) -> list[bytes]:
    """The bytes the capture's DATA records say were read, in order."""
    return [b for chunks in capture_streams(capture).values()
            for inbound, _, b in chunks if inbound]


@pytest.mark.parametrize("task_storage", [True, False], ids=["task-storage", "hash"])
def test_a_call_entered_before_a_pause_is_not_taken_after_the_resume(task_storage, tmp_path):
    """recv() #1 is held at its entry and returns while paused (its exit unseen);
    recv() #2 is entered while paused (unseen) and returns after the resume: its exit
    must not take #1's held call for its own (wrong buffer, wrong connection id). Only
    #3, entered after the resume, is sent."""
    p = subprocess.Popen([sys.executable, "-c", CHILD, "/dev/null"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        cap = tmp_path / "calls.ttcap"
        with traced(pids=[p.pid], task_storage=task_storage, record=str(cap)) as c:
            session = c.run.session
            assert session.task_storage is task_storage
            _say(p, "recv")
            time.sleep(0.3)  # the worker waits in recv() #1, held
            session.pause()
            _say(p, "send ONE")
            assert p.stdout.readline().split() == ["got", "ONE"]
            _say(p, "recv")
            time.sleep(0.3)  # the worker waits in recv() #2, entered while paused
            session.resume()
            _say(p, "send TWO")
            assert p.stdout.readline().split() == ["got", "TWO"]
            _say(p, "recv")
            time.sleep(0.3)
            _say(p, "send THREE")
            assert p.stdout.readline().split() == ["got", "THREE"]
        got = _inbound(cap)
        assert got == [b"THREE"], got
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("task_storage", [True, False], ids=["task-storage", "hash"])
def test_an_exit_never_takes_the_call_another_syscall_entered(task_storage, tmp_path):
    """A call whose exit goes unseen (here its probe taken out while the call waits; at
    an attach or a resume, the probes go in one after the other) stays held; the exit of
    a later syscall whose entry was not seen must not take it for its own: the exit
    says which syscall it is. Without that, the file's read below would be sent as the
    socket's bytes."""
    data = tmp_path / "plain.txt"
    data.write_text("FILEBYTES-not-a-socket")
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(data)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        cap = tmp_path / "calls.ttcap"
        with traced(pids=[p.pid], task_storage=task_storage, record=str(cap)) as c:
            bpf = c.run.session.bpf
            _say(p, "recv+file")
            time.sleep(0.3)  # the worker waits in recv(), its entry held
            bpf.detach_tracepoint(b"syscalls:sys_exit_recvfrom")
            bpf.detach_tracepoint(b"syscalls:sys_enter_read")
            # recv() returns, its exit unseen; then read(2) of a file, its entry unseen
            # and its exit seen
            _say(p, "send ONE")
            assert p.stdout.readline().split() == ["got", "ONE", "FILEBYTES-not-a-socket"]
            time.sleep(0.3)
        assert _inbound(cap) == []
    finally:
        p.kill()
        p.wait()
