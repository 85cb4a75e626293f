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
* payload fingerprints: the first ``FINGERPRINT_BYTES`` bytes one process wrote on a
  connection are the first bytes another process read on one, within
  ``MATCH_WINDOW_NS`` (unix sockets have no addresses to match). A connection's
  fingerprint is taken only when it was seen from its first byte.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import networkx as nx

FINGERPRINT_BYTES = 64
MATCH_WINDOW_NS = 2_000_000_000
MAX_PENDING = 4096  # unmatched fingerprints kept, oldest dropped first


@dataclass
class _Stream:
    """The first bytes of one direction of one connection."""

    head: bytearray = field(default_factory=bytearray)
    done: bool = False


class IpcGraph:
    """Processes as nodes, recognised links between them as edges."""

    def __init__(self, stats: Counter[str] | None = None) -> None:
        self.graph: nx.Graph = nx.Graph()
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self._streams: dict[tuple[int, int, int, bool], _Stream] = {}
        # fingerprint -> (pid, ts) of the writer / reader not yet matched
        self._written: dict[bytes, tuple[int, int]] = {}
        self._read: dict[bytes, tuple[int, int]] = {}
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

    def data(self, pid: int, fd: int, conn_id: int, inbound: bool, position: int,
             payload: bytes, ts: int) -> None:
        """Bytes a process moved on a connection (only the first few matter)."""
        key = (pid, fd, conn_id, inbound)
        st = self._streams.get(key)
        if st is None:
            if position != 0:
                return  # not seen from its start: no fingerprint
            st = self._streams[key] = _Stream()
        if st.done or position != len(st.head):
            st.done = True
            return
        st.head += payload[: FINGERPRINT_BYTES - len(st.head)]
        if len(st.head) < FINGERPRINT_BYTES:
            return
        st.done = True
        self._match(bytes(st.head), pid, ts, inbound)

    def closed(self, pid: int, fd: int, conn_id: int) -> None:
        """A connection ended: forget its streams."""
        self._streams.pop((pid, fd, conn_id, True), None)
        self._streams.pop((pid, fd, conn_id, False), None)

    def _match(self, fp: bytes, pid: int, ts: int, inbound: bool) -> None:
        mine, theirs = (self._read, self._written) if inbound else (self._written, self._read)
        other = theirs.pop(fp, None)
        if other is not None and other[0] != pid and abs(ts - other[1]) <= MATCH_WINDOW_NS:
            self.link(pid, other[0], "payload")
            return
        mine[fp] = (pid, ts)
        if len(mine) > MAX_PENDING:
            mine.pop(next(iter(mine)))

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
