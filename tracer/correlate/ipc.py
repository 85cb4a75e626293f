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
  addresses to match). A substring, not a prefix: a reader blocked in a read when the
  tracer attached misses the start of what was written (a length prefix, a message).
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
    """The first bytes seen of one direction of one connection."""

    pid: int
    ts: int
    inbound: bool
    data: bytearray = field(default_factory=bytearray)
    matched: bool = False

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
             ts: int) -> None:
        """Bytes a process moved on a connection (only the first few matter)."""
        key = (pid, fd, conn_id, inbound)
        h = self._heads.get(key)
        if h is None:
            h = self._heads[key] = _Head(pid, ts, inbound)
            pending = self._readers if inbound else self._writers
            pending.append(h)
            if len(pending) > MAX_PENDING:
                del pending[0]
        elif h.full or h.matched:
            return
        need = (FINGERPRINT_BYTES if inbound else WRITER_HEAD_BYTES) - len(h.data)
        h.data += payload[:need]
        if len(h.data) >= FINGERPRINT_BYTES:
            self._match(h)

    def closed(self, pid: int, fd: int, conn_id: int) -> None:
        """A connection ended: forget its heads."""
        self._heads.pop((pid, fd, conn_id, True), None)
        self._heads.pop((pid, fd, conn_id, False), None)

    def _match(self, h: _Head) -> None:
        if h.inbound:
            pairs = [(h, w) for w in self._writers]
        else:
            pairs = [(r, h) for r in self._readers if len(r.data) >= FINGERPRINT_BYTES]
        for r, w in pairs:
            if (r.pid != w.pid and not r.matched and abs(r.ts - w.ts) <= MATCH_WINDOW_NS
                    and bytes(r.data[:FINGERPRINT_BYTES]) in w.data):
                r.matched = True
                self._readers.remove(r)
                self.link(r.pid, w.pid, "payload")
                return

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
