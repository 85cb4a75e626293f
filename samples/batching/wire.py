"""Length-prefixed JSON messages over unix stream sockets (engine <-> API, rank 0 ->
rank 1): a 4-byte big-endian length, then that many bytes of UTF-8 JSON.

``FrameReader`` takes bytes and hands out messages and never touches a socket;
``send`` and ``recv`` are the blocking helpers the engine processes use.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

HEADER = struct.Struct(">I")
MAX_FRAME = 64 << 20


class ProtocolError(ValueError):
    """The peer sent something that is not a length-prefixed JSON object."""


def encode(msg: dict[str, Any]) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"frame is not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("frame is not a JSON object")
    return msg


class FrameReader:
    """Feed bytes as they come; take whole messages out."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self.buf += data
        out = []
        while len(self.buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self.buf)
            if n > MAX_FRAME:
                raise ProtocolError(f"frame of {n} bytes is over the {MAX_FRAME} limit")
            if len(self.buf) < HEADER.size + n:
                break
            out.append(decode(bytes(self.buf[HEADER.size:HEADER.size + n])))
            del self.buf[:HEADER.size + n]
        return out


def send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(encode(msg))


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            if data:
                raise ProtocolError("peer closed in the middle of a frame")
            return None
        data += chunk
    return bytes(data)


def recv(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or None when the peer has closed the socket."""
    head = _exactly(sock, HEADER.size)
    if head is None:
        return None
    (n,) = HEADER.unpack(head)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes is over the {MAX_FRAME} limit")
    body = _exactly(sock, n)
    if body is None:
        raise ProtocolError("peer closed in the middle of a frame")
    return decode(body)


def listen(path: str) -> socket.socket:
    """A listening unix stream socket at a filesystem path."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(1)
    return s


def connect(path: str, timeout: float = 120.0) -> socket.socket:
    """Connect to a unix stream socket, waiting for its listener to appear."""
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return s
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {path} after {timeout:.0f}s") from None
            time.sleep(0.05)
