"""Sockets from the kernel's sock_diag netlink interface (what `ss` uses), in the
caller's network namespace.

/proc/net/unix has no peer column, so a socketpair looks like two unrelated sockets.
``unix_peers()`` returns inode -> peer inode for every unix socket; a socket whose peer
is held by the same process is an in-process wake-up channel (asyncio's and libuv's
self-pipe), not traffic worth capturing.

``tcp_listening()`` returns inode -> port of the listening TCP sockets. /proc/net/tcp
lists every socket of the namespace, TIME_WAIT ones included (thousands on a busy
node, ~30 ms of kernel time and more of parsing per read); asked for the LISTEN state
only, the kernel walks its listening table alone.
"""

from __future__ import annotations

import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x01
NLM_F_DUMP = 0x300
NLMSG_DONE = 3
NLMSG_ERROR = 2
UDIAG_SHOW_PEER = 0x04
UNIX_DIAG_PEER = 2

_NLMSGHDR = struct.Struct("=IHHII")
_UNIX_DIAG_REQ = struct.Struct("=BBHIIIII")  # family, protocol, pad, states, ino, show, cookie[2]
_UNIX_DIAG_MSG = struct.Struct("=BBBBIII")  # family, type, state, pad, ino, cookie[2]
_RTATTR = struct.Struct("=HH")
# inet_diag_req_v2: family, protocol, ext, pad, states, then inet_diag_sockid (ports,
# addresses, interface, cookie: 48 bytes, zero = any)
_INET_DIAG_REQ = struct.Struct("=BBBBI48x")
# inet_diag_msg: family, state, timer, retrans (4 bytes), then the sockid (its source
# port first, big-endian), expires, rqueue, wqueue, uid, inode
_INET_DIAG_SPORT = 4
_INET_DIAG_INODE = 4 + 48 + 16
TCP_LISTEN = 10


def unix_peers() -> dict[int, int]:
    """inode -> peer inode for connected unix sockets ({} if sock_diag is unavailable)."""
    req = _UNIX_DIAG_REQ.pack(socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, UDIAG_SHOW_PEER, 0, 0)
    peers: dict[int, int] = {}
    for data, body, end in _dump(req) or ():
        ino = _UNIX_DIAG_MSG.unpack_from(data, body)[4]
        a = body + _UNIX_DIAG_MSG.size
        while a + _RTATTR.size <= end:
            alen, atype = _RTATTR.unpack_from(data, a)
            if alen < _RTATTR.size:
                break
            if atype == UNIX_DIAG_PEER and alen >= 8:
                peers[ino] = struct.unpack_from("=I", data, a + 4)[0]
            a += (alen + 3) & ~3
    return peers


def tcp_listening() -> dict[int, int] | None:
    """inode -> port of every listening TCP socket (IPv4 and IPv6), None if sock_diag
    cannot say (no netlink, a kernel without inet_diag)."""
    out: dict[int, int] = {}
    for family in (socket.AF_INET, socket.AF_INET6):
        msgs = _dump(_INET_DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << TCP_LISTEN))
        if msgs is None:
            return None
        for data, body, end in msgs:
            if end - body >= _INET_DIAG_INODE + 4:
                port = struct.unpack_from(">H", data, body + _INET_DIAG_SPORT)[0]
                out[struct.unpack_from("=I", data, body + _INET_DIAG_INODE)[0]] = port
    return out


def _dump(req: bytes) -> list[tuple[bytes, int, int]] | None:
    """A SOCK_DIAG_BY_FAMILY dump: per message its buffer and where its body starts and
    ends; None if the kernel refused (no netlink socket, an error message)."""
    try:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
    except OSError:
        return None
    out: list[tuple[bytes, int, int]] = []
    try:
        hdr = _NLMSGHDR.pack(_NLMSGHDR.size + len(req), SOCK_DIAG_BY_FAMILY,
                             NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
        s.sendall(hdr + req)
        while True:
            data = s.recv(1 << 16)
            if not data:
                return out
            off = 0
            while off + _NLMSGHDR.size <= len(data):
                length, mtype, _, _, _ = _NLMSGHDR.unpack_from(data, off)
                if length < _NLMSGHDR.size or mtype == NLMSG_DONE:
                    return out
                if mtype == NLMSG_ERROR:
                    return None
                out.append((data, off + _NLMSGHDR.size, off + length))
                off += (length + 3) & ~3
    except OSError:
        return None
    finally:
        s.close()
