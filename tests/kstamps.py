"""The kernel's own timestamps of a reference client's TCP socket, so the client's truth
holds none of the client's own waits for a CPU.

Linux stamps a socket's segments in software when asked (``SO_TIMESTAMPING``):

- TX: when the bytes of a send() went through the device (on loopback,
  ``loopback_xmit``: the moment they reach the server's socket), read back from the
  socket's error queue, one stamp per send() keyed by the offset of its last byte
  (a stamp can come after the send returned: the key tells an old one from this one);
- RX: when a segment entered the receive path (``netif_rx``), handed back with each
  recvmsg() as the stamp of the last segment it copied from; ``MSG_PEEK`` does the same
  without consuming, so peeking up to a given byte gives the arrival of the segment
  that holds it.

All stamps are CLOCK_REALTIME. A client that reads its own clock around send() and
recv() also times its waits for a CPU: on a loaded 2-vCPU VM a few milliseconds in
about one request of fifty, which is the client's wait, not the server's latency. The
user-clock stamps are kept beside the kernel's so those waits can be reported apart.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import os
import select
import selectors
import socket
import struct
import threading
import time

SO_TIMESTAMPING = 37  # <asm-generic/socket.h>; SCM_TIMESTAMPING is the same number
SOF_TX_SOFTWARE = 1 << 1  # <linux/net_tstamp.h>
SOF_RX_SOFTWARE = 1 << 3
SOF_SOFTWARE = 1 << 4
SOF_OPT_ID = 1 << 7  # each TX stamp says which byte it is for (sock_extended_err.ee_data)
SOF_OPT_TSONLY = 1 << 11  # error-queue stamps without a copy of the packet
_EE_ORIGIN_TIMESTAMPING = 4
_CMSG = socket.CMSG_SPACE(48) + socket.CMSG_SPACE(64)


def _stamp(ancdata: list[tuple[int, int, bytes]]) -> int | None:
    """The software stamp (the first of three timespecs) of an SCM_TIMESTAMPING cmsg."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPING and len(data) >= 16:
            sec, nsec = struct.unpack_from("qq", data)
            if sec or nsec:
                return sec * 1_000_000_000 + nsec
    return None


_keeper: socket.socket | None = None
_keeper_lock = threading.Lock()


def _keep_rx_stamping_on() -> None:
    """Received packets are stamped only while some socket asks for it, and the first
    such socket turns it on through a deferred work item: early segments of the first
    connection would go unstamped. One socket kept open for the process keeps it on;
    the first caller waits until a datagram to itself comes back stamped."""
    global _keeper
    with _keeper_lock:
        if _keeper is not None:
            return
        k = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        k.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, SOF_RX_SOFTWARE | SOF_SOFTWARE)
        k.bind(("127.0.0.1", 0))
        k.settimeout(1.0)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            k.sendto(b"x", k.getsockname())
            _, anc, _, _ = k.recvmsg(1, _CMSG)
            if _stamp(anc) is not None:
                break
            time.sleep(0.01)
        else:
            raise RuntimeError("the kernel does not stamp received packets")
        _keeper = k


def _key(ancdata: list[tuple[int, int, bytes]]) -> int | None:
    """The byte offset a TX stamp is for: ``ee_data`` of its ``sock_extended_err``."""
    for level, _, data in ancdata:
        if level != socket.SOL_SOCKET and len(data) >= 16:
            errno_, origin = struct.unpack_from("IB", data)
            if origin == _EE_ORIGIN_TIMESTAMPING:
                return struct.unpack_from("I", data, 12)[0]
    return None


class StampedSocket:
    """A connected TCP socket whose sends and receives carry the kernel's stamps."""

    def __init__(self, sock: socket.socket) -> None:
        _keep_rx_stamping_on()
        self.sock = sock
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING,
                        SOF_TX_SOFTWARE | SOF_RX_SOFTWARE | SOF_SOFTWARE | SOF_OPT_ID
                        | SOF_OPT_TSONLY)
        self.sent_bytes = 0  # since the option was set: the TX stamps' keys count from here
        self._errpoll = select.poll()
        self._errpoll.register(sock, 0)  # POLLERR is always reported: the error queue

    def send(self, data: bytes) -> tuple[int, int]:
        """Send all of ``data``; returns (kernel TX stamp of its last byte, the user
        clock just before the send), both realtime ns."""
        user = time.time_ns()
        self.sock.sendall(data)
        stamp = self.sent(len(data))
        assert stamp is not None, "nothing sent"
        return stamp, user

    def sent(self, n: int) -> int | None:
        """``n`` more bytes were sent (by whoever owns the socket): the TX stamp of the
        last of them (None for no bytes). Older stamps still queued are passed over."""
        if n <= 0:
            return None
        self.sent_bytes += n
        want = self.sent_bytes - 1
        deadline = time.monotonic() + 2.0
        timeout = self.sock.gettimeout()
        self.sock.settimeout(0.0)  # a socket timeout would wait for POLLIN, not the queue
        try:
            while True:
                try:
                    _, anc, _, _ = self.sock.recvmsg(1, _CMSG, socket.MSG_ERRQUEUE)
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no TX timestamp for byte {want}") from None
                    self._errpoll.poll(20)
                    continue
                key = _key(anc)
                stamp = _stamp(anc)
                if key is not None and stamp is not None and key >= want:
                    return stamp
        finally:
            self.sock.settimeout(timeout)

    def peek(self, n: int = 65536) -> tuple[bytes, int | None]:
        """Wait for data; return up to ``n`` bytes without consuming them, with the
        arrival stamp of the segment holding the last of them."""
        data, anc, _, _ = self.sock.recvmsg(n, _CMSG, socket.MSG_PEEK)
        return data, _stamp(anc)

    def recv(self, n: int = 65536) -> tuple[bytes, int | None, int]:
        """Up to ``n`` bytes; the arrival stamp of the segment holding the last of them
        and the user clock right after the call (realtime ns)."""
        data, anc, _, _ = self.sock.recvmsg(n, _CMSG)
        return data, _stamp(anc), time.time_ns()

    def recv_exactly(self, n: int) -> tuple[bytes, int | None, int]:
        """``n`` bytes, reading again after a short read (fewer only where the stream
        ended first); stamps as ``recv``'s, of the read that took the last of them."""
        got, at, user = b"", None, 0
        while len(got) < n:
            data, at, user = self.recv(n - len(got))
            if not data:
                break
            got += data
        return got, at, user

    def close(self) -> None:
        self.sock.close()


def drive(clients: list, begin: Callable[[int, int, Any], None], per_client: int,
          finished: Callable[[Any], None] | None = None) -> list[dict]:
    """Run ``per_client`` calls on each client, all clients at once, from this one
    thread: ``begin(i, k, client)`` starts client i's k-th call, and ``client.step()``
    handles its socket when readable, returning the call's result once it ends;
    ``finished(client)`` is called once a client's last call has ended. One
    thread reads each socket as soon as it is readable: many client threads would make
    each other wait for the GIL, and a late read lets TCP merge a token's segment into
    a later one's buffer, whose stamp is then the later one's."""
    sel = selectors.DefaultSelector()
    done: list[dict] = []
    left = {}
    for i, c in enumerate(clients):
        begin(i, 0, c)
        left[c] = per_client - 1
        sel.register(c.sock, selectors.EVENT_READ, (i, c))
    while sel.get_map():
        for key, _ in sel.select(timeout=30):
            i, c = key.data
            r = c.step()
            if r is None:
                continue
            done.append(r)
            if left[c]:
                begin(i, per_client - left[c], c)
                left[c] -= 1
            else:
                sel.unregister(c.sock)
                if finished is not None:
                    finished(c)
    sel.close()
    return done


@contextmanager
def realtime_thread() -> Iterator[None]:
    """Run the calling thread under SCHED_FIFO for the block (children it forks reset
    to normal): the clock reads of a reference client must not wait for a CPU.

    Measured on the shared 2-vCPU VM (load average ~4), 200 wire calls: as a normal
    thread the client lost its CPU inside the request's send() in 30 calls and got
    back to its recv() 2-12 ms after the server's response write in 14; all of that
    is the client's own wait, not the server's TTFT. Real-time: 0 and 0."""
    old = os.sched_getscheduler(0), os.sched_getparam(0)
    os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(1))
    try:
        yield
    finally:
        os.sched_setscheduler(0, old[0], old[1])
