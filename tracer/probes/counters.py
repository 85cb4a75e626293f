"""Cumulative per-thread counters in a BPF hash, read as deltas."""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator


class CounterDeltas:
    """Reads a BPF hash of cumulative per-thread counters (keys with ``pid`` and
    ``tid``) as deltas since the previous read, so that what is sent sums to the exact
    totals. Entries of exited threads are read one last time, then deleted: a dead
    thread cannot count any more, so nothing is lost and the map does not fill up."""

    def __init__(self, bpf: Any, name: bytes,
                 values: Callable[[Any], tuple[int, ...]]) -> None:
        self.bpf = bpf
        self.name = name
        self.values = values
        self._last: dict[bytes, tuple[int, ...]] = {}

    def read(self) -> Iterator[tuple[Any, list[int]]]:
        """(key, deltas) for every entry that changed."""
        table = self.bpf[self.name]
        items = list(table.items())
        # decided before reading: a thread found dead here cannot change its counters
        gone = {(k.pid, k.tid) for k, _ in items
                if not os.path.exists(f"/proc/{k.pid}/task/{k.tid}")}
        for k, v in table.items():
            key = bytes(k)
            now = self.values(v)
            last = self._last.get(key)
            if now != last:
                yield k, [a - b for a, b in zip(now, last or (0,) * len(now))]
            if (k.pid, k.tid) in gone:
                self._last.pop(key, None)
                try:
                    del table[k]
                except KeyError:
                    pass
            else:
                self._last[key] = now
