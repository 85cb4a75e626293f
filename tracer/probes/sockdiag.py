"""Unix socket peers from the kernel's sock_diag netlink interface (what `ss -x` uses).

/proc/net/unix has no peer column, so a socketpair looks like two unrelated sockets.
``unix_peers()`` returns inode -> peer inode for every unix socket in the caller's
network namespace; a socket whose peer is held by the same process is an in-process
wake-up channel (asyncio's and libuv's self-pipe), not traffic worth capturing.
"""

from __future__ import annotations

import os
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


def unix_peers() -> dict[int, int]:
    """inode -> peer inode for connected unix sockets ({} if sock_diag is unavailable)."""
    try:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
    except OSError:
        return {}
    peers: dict[int, int] = {}
    try:
        req = _UNIX_DIAG_REQ.pack(socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, UDIAG_SHOW_PEER, 0, 0)
        hdr = _NLMSGHDR.pack(_NLMSGHDR.size + len(req), SOCK_DIAG_BY_FAMILY,
                             NLM_F_REQUEST | NLM_F_DUMP, 1, os.getpid())
        s.sendall(hdr + req)
        while True:
            data = s.recv(1 << 16)
            if not data:
                return peers
            off = 0
            while off + _NLMSGHDR.size <= len(data):
                length, mtype, _, _, _ = _NLMSGHDR.unpack_from(data, off)
                if length < _NLMSGHDR.size:
                    return peers
                if mtype in (NLMSG_DONE, NLMSG_ERROR):
                    return peers
                body = off + _NLMSGHDR.size
                ino = _UNIX_DIAG_MSG.unpack_from(data, body)[4]
                a = body + _UNIX_DIAG_MSG.size
                end = off + length
                while a + _RTATTR.size <= end:
                    alen, atype = _RTATTR.unpack_from(data, a)
                    if alen < _RTATTR.size:
                        break
                    if atype == UNIX_DIAG_PEER and alen >= 8:
                        peers[ino] = struct.unpack_from("=I", data, a + 4)[0]
                    a += (alen + 3) & ~3
                off += (length + 3) & ~3
    except OSError:
        return peers
    finally:
        s.close()
