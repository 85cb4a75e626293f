"""The process graph: which traced processes talk to each other.

An inference service is often an API process and one or more engine processes (vLLM's
API server and engine core, TGI's router and shards, tensor-parallel ranks) linked by
unix sockets or TCP on loopback. The socket probes see both ends of such a link; this
module recognises them as one flow and joins the processes in a networkx graph, so the
correlator can charge an engine process's GPU work to the requests its API process
served (``serving_group``).

Two ends are recognised by:

* addresses: a TCP connection whose local address is the other one's peer address and
  the other way round (loopback TCP);
* payload fingerprints: the first ``FINGERPRINT_BYTES`` bytes a process was seen
  reading on a connection occur within the first ``WRITER_HEAD_BYTES`` bytes another
  process was seen writing on one, within ``MATCH_WINDOW_NS`` (unix sockets have no
  addresses to match). A substring, not a prefix, where either end was found open at
  attach: a reader blocked in a read when the tracer attached misses the start of what
  was written (a length prefix, a message). Two ends both seen from their first byte
  carry the same bytes from the start, so there the reader's fingerprint is the
  writer's first bytes: a dictionary look-up, not a scan of every pending head (a
  server with many new connections a second made the scan its hottest path).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import networkx as nx

FINGERPRINT_BYTES = 48
WRITER_HEAD_BYTES = 2048
MATCH_WINDOW_NS = 2_000_000_000
MAX_PENDING = 512  # unmatched heads kept per side, oldest dropped first


@dataclass
class _Head:
    """The first bytes seen of one direction of one connection. ``start``: they are its
    first bytes (the connection was seen from its start, nothing lost before them)."""

    pid: int
    ts: int
    inbound: bool
    start: bool = False
    data: bytearray = field(default_factory=bytearray)
    matched: bool = False
    searched: int = 0  # bytes of a writer's head already searched by pending readers

    @property
    def full(self) -> bool:
        return len(self.data) >= (FINGERPRINT_BYTES if self.inbound else WRITER_HEAD_BYTES)


class IpcGraph:
    """Processes as nodes, recognised links between them as edges."""

    def __init__(self, stats: Counter[str] | None = None) -> None:
        self.graph: nx.Graph = nx.Graph()
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self._heads: dict[tuple[int, int, int, bool], _Head] = {}
        self._writers: list[_Head] = []  # unmatched, oldest first
        self._readers: list[_Head] = []
        # the pending heads found open at attach (not start), in the same order: the
        # only ones a head seen from its start is searched against
        self._open_writers: list[_Head] = []
        self._open_readers: list[_Head] = []
        # heads seen from their start, by their first FINGERPRINT_BYTES bytes
        self._start_writers: dict[bytes, list[_Head]] = {}
        self._start_readers: dict[bytes, list[_Head]] = {}
        self._addrs: dict[tuple[str, int, str, int], int] = {}
        self._groups: dict[int, frozenset[int]] = {}

    def link(self, a: int, b: int, how: str) -> None:
        """Join two processes (counted once per pair and kind of evidence)."""
        if a == b:
            return
        if not self.graph.has_edge(a, b):
            self.graph.add_edge(a, b, how=set())
            self._groups.clear()
            self.stats["ipc_links"] += 1
        how_set = self.graph.edges[a, b]["how"]
        if how not in how_set:
            how_set.add(how)

    def connection(self, pid: int, local: tuple[str, int], peer: tuple[str, int]) -> None:
        """A TCP connection's addresses, once known: its other end may be traced too."""
        if not local[1] or not peer[1]:
            return
        other = self._addrs.get((peer[0], peer[1], local[0], local[1]))
        if other is not None:
            self.link(pid, other, "tcp")
        self._addrs[(local[0], local[1], peer[0], peer[1])] = pid
        if len(self._addrs) > MAX_PENDING * 4:
            self._addrs.pop(next(iter(self._addrs)))

    def data(self, pid: int, fd: int, conn_id: int, inbound: bool, payload: bytes,
             ts: int, start: bool = False) -> bool:
        """Bytes a process moved on a connection (only the first few matter). ``start``:
        the first call for this direction carries its first bytes (seen from the
        connection's start, nothing lost before); otherwise its head may begin anywhere.
        Returns whether later bytes of this direction could still matter."""
        key = (pid, fd, conn_id, inbound)
        h = self._heads.get(key)
        if h is None:
            h = self._heads[key] = _Head(pid, ts, inbound, start)
            pending = self._readers if inbound else self._writers
            pending.append(h)
            if not start:
                (self._open_readers if inbound else self._open_writers).append(h)
            if len(pending) > MAX_PENDING:
                self._forget(pending.pop(0))
        elif h.full or h.matched:
            return False
        had = len(h.data)
        need = (FINGERPRINT_BYTES if inbound else WRITER_HEAD_BYTES) - had
        h.data += payload[:need]
        if len(h.data) < FINGERPRINT_BYTES:
            return True
        if had < FINGERPRINT_BYTES and h.start:
            index = self._start_readers if inbound else self._start_writers
            index.setdefault(bytes(h.data[:FINGERPRINT_BYTES]), []).append(h)
        if inbound:
            self._match_reader(h)
        else:
            self._match_writer(h, had)
        return not (h.full or h.matched)

    def closed(self, pid: int, fd: int, conn_id: int) -> None:
        """A connection ended: forget its heads."""
        self._heads.pop((pid, fd, conn_id, True), None)
        self._heads.pop((pid, fd, conn_id, False), None)

    def _forget(self, h: _Head) -> None:
        """``h`` leaves the pending heads (matched, or the oldest of too many)."""
        if not h.start:
            opened = self._open_readers if h.inbound else self._open_writers
            if h in opened:
                opened.remove(h)
            return
        if len(h.data) < FINGERPRINT_BYTES:
            return
        index = self._start_readers if h.inbound else self._start_writers
        fp = bytes(h.data[:FINGERPRINT_BYTES])
        same = index.get(fp)
        if same is not None and h in same:
            same.remove(h)
            if not same:
                del index[fp]

    @staticmethod
    def _pair(r: _Head, w: _Head) -> bool:
        return r.pid != w.pid and not r.matched and abs(r.ts - w.ts) <= MATCH_WINDOW_NS

    def _match_reader(self, r: _Head) -> None:
        """A reader's fingerprint is complete: the writer whose head holds it."""
        fp = bytes(r.data[:FINGERPRINT_BYTES])
        if r.start:  # its match is a writer seen from the start with the same first bytes,
            for w in self._start_writers.get(fp, ()):  # or one found open at attach
                if self._pair(r, w):
                    return self._link(r, w)
            cands = self._open_writers
        else:
            cands = self._writers
        for w in cands:
            if self._pair(r, w) and fp in w.data:
                return self._link(r, w)

    def _match_writer(self, w: _Head, had: int) -> None:
        """A writer's head grew from ``had`` bytes: the pending reader it now holds.
        Readers were searched for in its first ``w.searched`` bytes when they (or
        those bytes) came, so only the rest is searched, with an overlap of one
        fingerprint less a byte."""
        new = w.data[max(0, w.searched - FINGERPRINT_BYTES + 1):]
        w.searched = len(w.data)
        if w.start and had < FINGERPRINT_BYTES:
            for r in self._start_readers.get(bytes(w.data[:FINGERPRINT_BYTES]), ()):
                if self._pair(r, w):
                    return self._link(r, w)
        for r in self._open_readers if w.start else self._readers:
            if (len(r.data) >= FINGERPRINT_BYTES and self._pair(r, w)
                    and bytes(r.data[:FINGERPRINT_BYTES]) in new):
                return self._link(r, w)

    def _link(self, r: _Head, w: _Head) -> None:
        r.matched = True
        self._readers.remove(r)
        self._forget(r)
        self.link(r.pid, w.pid, "payload")

    def serving_group(self, pid: int) -> frozenset[int]:
        """``pid`` and every process linked to it, directly or not."""
        g = self._groups.get(pid)
        if g is None:
            g = (frozenset(nx.node_connected_component(self.graph, pid))
                 if pid in self.graph else frozenset((pid,)))
            for p in g:
                self._groups[p] = g
        return g

    def edges(self) -> list[tuple[int, int, list[str]]]:
        """The links found, for reports: (pid, pid, kinds of evidence)."""
        return sorted((min(a, b), max(a, b), sorted(d["how"]))
                      for a, b, d in self.graph.edges(data=True))
