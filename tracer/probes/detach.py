"""Detaching uprobes without stalling the agent.

Closing a uprobe's perf event blocks ~0.1 s in the kernel (it waits for a grace
period, serialised under one lock: 1.0 s for 8 probes on an H100 host), and the agent
must keep draining the ring buffer meanwhile, so detaches run on a thread of their own.
BCC's attach/detach bookkeeping is guarded by one lock shared by every caller.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


def detach_in_background(bpf: Any, lock: threading.Lock, probes: list[tuple[bytes, int]],
                         errors: dict[str, str], label: str,
                         done: Callable[[float], None] | None = None) -> threading.Thread:
    """Detach the uprobes at (path, ELF address) on a new thread, and call ``done``
    with the seconds it took; failures go to ``errors``."""

    def run() -> None:
        t0 = time.perf_counter()
        for path, addr in probes:
            try:
                with lock:
                    bpf.detach_uprobe(name=path, addr=addr)
            except Exception as e:  # BCC raises bare Exception
                errors[f"{path.decode()}@{addr:#x} ({label})"] = str(e)
        if done is not None:
            done(time.perf_counter() - t0)

    t = threading.Thread(target=run, name=f"tt-detach-{label}", daemon=True)
    t.start()
    return t
