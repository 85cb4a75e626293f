"""Controlling a running `tokentrace run`: pause and resume its probes, and the toggles
the overhead benchmark measures each part of the tracer with.

- SIGUSR1 pauses (every probe out but process start/exit; the agent keeps running and
  keeps what it learnt), SIGUSR2 resumes. Acted on at the next poll (within ~20 ms).
- ``--control PATH``: a unix stream socket (created 0600) taking one command per
  connection, one line, and answering one line: ``ok ...`` or ``error: ...``. The
  commands are ``CaptureSession.control``'s. ``tokentrace ctl PATH COMMAND`` sends one.

A pause is an event of the capture (``schema.TracingPaused``), so a replay ends the
same requests at it as the live run did.
"""

from __future__ import annotations

import os
import select
import signal
import socket
from pathlib import Path
from typing import Any, Callable

MAX_COMMAND = 256


class Controller:
    """Signals and the control socket of one run; ``poll`` applies what came."""

    def __init__(self, apply: Callable[[str], str], path: str | None = None,
                 signals: bool = True) -> None:
        self.apply = apply
        self.pending: list[str] = []
        self.path = path
        self.sock: socket.socket | None = None
        if signals:
            signal.signal(signal.SIGUSR1, lambda *_: self.pending.append("pause"))
            signal.signal(signal.SIGUSR2, lambda *_: self.pending.append("resume"))
        if path:
            p = Path(path)
            if p.is_socket():
                p.unlink()  # a dead run's socket
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o177)
            try:
                s.bind(path)
            finally:
                os.umask(old)
            s.listen(8)
            s.setblocking(False)
            self.sock = s

    def poll(self) -> None:
        """Apply signals received and answer the commands waiting on the socket."""
        while self.pending:
            self.apply(self.pending.pop(0))
        if self.sock is None:
            return
        while select.select([self.sock], [], [], 0)[0]:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return
            with conn:
                conn.settimeout(1.0)
                try:
                    line = _read_line(conn)
                    reply = self.apply(line) if line is not None else "error: no command"
                    conn.sendall(reply.encode() + b"\n")
                except OSError:
                    continue  # the client went away: its command is not applied twice

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            if self.path:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass


def _read_line(conn: socket.socket) -> str | None:
    buf = b""
    while b"\n" not in buf and len(buf) <= MAX_COMMAND:
        chunk = conn.recv(MAX_COMMAND)
        if not chunk:
            break
        buf += chunk
    line = buf.split(b"\n", 1)[0].decode("utf-8", "replace").strip()
    return line or None


def send(path: str, command: str, timeout: float = 30.0) -> str:
    """Send one command to a run's control socket; its reply line."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(command.strip().encode() + b"\n")
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
    return reply.decode("utf-8", "replace").strip()


def restore_signals() -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)


__all__: list[Any] = ["Controller", "send", "restore_signals"]
