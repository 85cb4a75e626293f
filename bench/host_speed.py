"""How fast the host runs code that is neither the server's nor the agent's: a meter for
bench/real_server.py, to tell whether the host itself slows down while the agent works
(CPU frequency and power limits, a hypervisor's placement of virtual CPUs, a shared
last-level cache) and whether slice-to-slice noise in a server's tokens/s is the host's.

Each meter is a Python loop pinned to a CPU nobody else uses, counting finished chunks
of fixed work into an 8-byte shared file the bench reads at a slice's start and end:

- ``cpu``: small-state interpreter work (a dict and a few integers: L1/L2 resident),
  which slows with the core's clock and with a sibling hyperthread's load;
- ``cache``: pseudo-random reads over a 32 MiB array (past any core's L2, inside the
  shared L3), which slows too when others fill the last-level cache or the memory bus.

``AgentLoad`` is the same cache work at a set duty cycle on the agent's CPUs, stopped
and continued by the bench: what any such load beside the servers costs them, to hold
against what the agent's analysis costs them.

    python bench/host_speed.py FILE cpu|cache | load DUTY   (run by the classes below)
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path

KINDS = ("cpu", "cache")
CACHE_WORDS = 1 << 22  # 4 Mi 8-byte words: 32 MiB


def _cpu_chunk() -> None:
    d: dict[int, int] = {}
    for i in range(4000):
        k = i & 63
        d[k] = d.get(k, 0) + i


def _cache_chunk(a: array, state: list[int]) -> None:
    x, s, mask = state[0], 0, CACHE_WORDS - 1
    for _ in range(4000):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        s += a[x & mask]
    state[0] = x


def _cache_work() -> Callable[[], None]:
    """A chunk of cache work over an array of its own (built here: ~0.5 s)."""
    a, state = array("q", range(CACHE_WORDS)), [1]
    return lambda: _cache_chunk(a, state)


def _spawn(args: list[str], cpus: set[int]) -> subprocess.Popen[bytes]:
    """This file run with ``args`` on ``cpus``."""
    return subprocess.Popen([sys.executable, __file__, *args],
                            preexec_fn=lambda: os.sched_setaffinity(0, cpus))


def meter(path: str, kind: str) -> None:
    """Count chunks of ``kind`` work into ``path`` (8 bytes, native order) forever."""
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 8)
    count = memoryview(m).cast("Q")
    work = _cpu_chunk if kind == "cpu" else _cache_work()
    n = 0
    while True:
        work()
        n += 1
        count[0] = n


def load(duty: float) -> None:
    """The cache work, busy ``duty`` of every 10 ms and asleep the rest, forever."""
    work = _cache_work()
    while True:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.01 * duty:
            work()
        time.sleep(0.01 * (1.0 - duty))


class SpeedMeters:
    """One meter per kind, each on its own CPU of ``cpus`` (as many kinds as CPUs, in
    KINDS' order); ``read()`` gives each meter's chunk count now."""

    def __init__(self, work: Path, cpus: list[int]) -> None:
        self.counts: dict[str, memoryview] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self._maps: list[mmap.mmap] = []
        for kind, cpu in zip(KINDS, cpus):
            path = work / f"speed-{kind}"
            path.write_bytes(b"\0" * 8)
            self.procs.append(_spawn([str(path), kind], {cpu}))
            with open(path, "r+b") as f:
                m = mmap.mmap(f.fileno(), 8)
            self._maps.append(m)
            self.counts[kind] = memoryview(m).cast("Q")

    def read(self) -> dict[str, int]:
        return {kind: int(c[0]) for kind, c in self.counts.items()}

    def wait_started(self, timeout_s: float = 30.0) -> None:
        """Until every meter has counted (the cache meter builds its array first)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and not all(self.read().values()):
            time.sleep(0.1)

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        for c in self.counts.values():
            c.release()
        for m in self._maps:
            m.close()


class AgentLoad:
    """A load of ``cores`` (0-1) of cache work on ``cpus``, started stopped; ``set(on)``
    continues or stops it."""

    def __init__(self, cpus: set[int], cores: float) -> None:
        self.proc = _spawn(["load", f"{cores:g}"], cpus)
        time.sleep(1.0)  # its array built (a fraction of a second)
        self.set(False)

    def set(self, on: bool) -> None:
        self.proc.send_signal(signal.SIGCONT if on else signal.SIGSTOP)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


if __name__ == "__main__":
    if sys.argv[1] == "load":
        load(float(sys.argv[2]))
    else:
        meter(sys.argv[1], sys.argv[2])
