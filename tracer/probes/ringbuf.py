"""The events ring buffer, read in place.

BCC hands each record of a BPF ring buffer to Python through a ctypes callback
(libbpf's ``ring_buffer__consume``), then the callback copies it out with
``ctypes.string_at``: ~1.5 µs a record on the 2-vCPU VM, and a busy server sends
over 100,000 records a second (one per token written). The kernel lets the consumer
map the ring instead (``BPF_MAP_TYPE_RINGBUF``: one read-write page holding the
consumer position, then, read-only, the producer position's page and the data pages
mapped twice in a row, so a record that wraps is still contiguous). ``RingReader``
walks it as libbpf does: from the consumer position to the producer position, each
record an 8-byte header (length with a BUSY bit while the producer still writes it
and a DISCARD bit for a record given back) and its data rounded up to 8 bytes; it
stops at a record still BUSY, skips discarded ones and publishes the new consumer
position, which frees the space for the producer. ~0.5 µs a record.

How full the ring got is measured where the producer's view is known exactly: it
sees the consumer position last published, so the most it can find in the ring
between two publications is the producer position at the second less the first.
``RingReader`` takes that difference at every publication and at the start of each
read (``peak``, ``take_peak``): a record lost with the ring far from full was
refused for another reason than room (the reservation's lock, Linux 6.15+).

Reading the positions and headers without barriers is sound on x86-64, whose loads
are not reordered with other loads (the kernel's release store of a header is seen
after the data it publishes). Elsewhere, and wherever the ring cannot be mapped,
``open_reader`` falls back to BCC's callback.
"""

from __future__ import annotations

import ctypes
import mmap
import platform
import select
import struct
import time
from typing import Any, Callable

BUSY = 1 << 31
DISCARD = 1 << 30
HEADER = 8  # u32 length and flags, u32 page offset (the kernel's)
_POS = struct.Struct("<Q")
_LEN = struct.Struct("<I")
PUBLISH_EVERY = 256  # records between updates of the consumer position in a long read
CLOCK_EVERY = 32  # records between looks at the clock in a read with a time budget


class RingReader:
    """A ring buffer map (``map_fd``, ``size`` bytes of data) mapped and read in
    place; each record's bytes go to ``on_record``."""

    def __init__(self, map_fd: int, size: int, on_record: Callable[[bytes], None]) -> None:
        if size <= 0 or size & (size - 1) or size % mmap.PAGESIZE:
            raise ValueError(f"a ring buffer's size is a power-of-two number of pages, not {size}")
        page = mmap.PAGESIZE
        self.size = size
        self.on_record = on_record
        self.errors = 0  # records whose handler raised (BCC's callback prints and goes on)
        self.behind = False  # the last read stopped at its budget with records unread
        self.peak = 0  # the most bytes the producer found in the ring, records and headers
        self._window_peak = 0  # the same since the last take_peak()
        self._cons = mmap.mmap(map_fd, page, mmap.MAP_SHARED,
                               mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        try:
            self._prod = mmap.mmap(map_fd, page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ,
                                   offset=page)
        except BaseException:
            self._cons.close()
            raise
        self._epoll = select.epoll()
        self._epoll.register(map_fd, select.EPOLLIN)

    def wait(self, timeout_ms: int) -> None:
        """Sleep until the producer wakes the ring or ``timeout_ms`` passes."""
        self._epoll.poll(timeout_ms / 1000.0)

    def consume(self, budget_s: float | None = None) -> int:
        """Every committed record now in the ring, in order; returns how many. With
        ``budget_s``, stops once that long has passed with records still unread
        (``behind`` says so): a producer that writes as fast as this reads would
        otherwise keep it here for good, records committed meanwhile included."""
        cons, prod, on_record = self._cons, self._prod, self.on_record
        mask = self.size - 1
        base = mmap.PAGESIZE  # the data pages follow the producer position's page
        c = _POS.unpack_from(cons, 0)[0]
        p = _POS.unpack_from(prod, 0)[0]
        self._saw(p - c)  # since the last read's end, nothing was taken out
        published = c
        n = 0
        self.behind = False
        deadline = None if budget_s is None else time.monotonic() + budget_s
        try:
            while c < p:
                if (deadline is not None and n and not n % CLOCK_EVERY
                        and time.monotonic() > deadline):
                    self.behind = True
                    break
                at = base + (c & mask)
                word = _LEN.unpack_from(prod, at)[0]
                if word & BUSY:
                    break  # still being written: it and what follows wait for the next read
                length = word & ~(BUSY | DISCARD)
                c += (length + HEADER + 7) & ~7
                if not word & DISCARD:
                    n += 1
                    try:
                        on_record(prod[at + HEADER:at + HEADER + length])
                    except Exception:  # the handler's to count; the ring goes on
                        self.errors += 1
                    if not n % PUBLISH_EVERY:  # room for the producer meanwhile
                        self._saw(_POS.unpack_from(prod, 0)[0] - published)
                        _POS.pack_into(cons, 0, c)
                        published = c
                if c >= p:
                    p = _POS.unpack_from(prod, 0)[0]
        finally:
            self._saw(_POS.unpack_from(prod, 0)[0] - published)
            _POS.pack_into(cons, 0, c)
        return n

    def _saw(self, fill: int) -> None:
        if fill > self._window_peak:
            self._window_peak = fill
            if fill > self.peak:
                self.peak = fill

    def take_peak(self) -> int:
        """The most bytes the producer found in the ring since the last call (or since
        the reader opened): records not yet read, their headers included."""
        peak, self._window_peak = self._window_peak, 0
        return peak

    def close(self) -> None:
        self._epoll.close()
        self._prod.close()
        self._cons.close()


class BccReader:
    """The same interface over BCC's own reader (its ctypes callback per record)."""

    def __init__(self, bpf: Any, table: Any, on_record: Callable[[bytes], None]) -> None:
        self.bpf = bpf
        self.behind = False
        table.open_ring_buffer(lambda _ctx, data, size: on_record(ctypes.string_at(data, size)))

    def wait(self, timeout_ms: int) -> None:
        self.bpf.ring_buffer_poll(timeout_ms)

    def consume(self, budget_s: float | None = None) -> int:
        """Everything in the ring (BCC's reader takes no budget: never ``behind``)."""
        self.bpf.ring_buffer_consume()
        return 0  # BCC does not say

    def close(self) -> None:
        pass


def open_reader(bpf: Any, name: bytes, on_record: Callable[[bytes], None]
                ) -> RingReader | BccReader:
    """A reader of ring buffer ``name`` of the BCC program ``bpf``: mapped in place on
    x86-64, BCC's callback elsewhere or if the ring cannot be mapped."""
    table = bpf[name]
    if platform.machine() in ("x86_64", "AMD64"):
        try:
            return RingReader(table.map_fd, table.max_entries, on_record)
        except (OSError, ValueError):
            pass
    return BccReader(bpf, table, on_record)
