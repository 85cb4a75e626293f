"""The driver's kernel-alias look-ups, probed only while they may tell something new.

``cuKernelGetFunction(CUfunction *out, CUkernel)`` gives the function handle a launch
uses for a kernel the library resolved by name (``cuLibraryGetKernel``); its probes
(bpf/cuda.c, "kernel names"), at entry and return, tell that the handle is an alias of
a named kernel. Some libraries call it before every launch: HF serve with continuous
batching on an H200 made ~950 a second (0.35 per output token), each an entry and a
return trap on the thread that holds the GIL, and after the first of each alias the
kernel sends nothing (``alias_sent``). So these probes are a window
(tracer/probes/window.py): open from attach, closed once look-ups have gone on for
``quiet_s`` seconds with no new handle, and opened again when a traced process with
libcuda is found or when a launched handle has no name (``TraceRun.ask_unnamed``):
a library that looks its kernels up before every launch tells the alias at the next
one. The look-ups by name (``cuModuleGetFunction``, ``cuLibraryGetKernel``: once per
kernel) stay attached. An alias made once while the window is closed is named the way
a kernel resolved before attach is (host stubs, the process's memory:
tracer/probes/stubnames.py, tracer/probes/prenames.py).
"""

from __future__ import annotations

import ctypes
from collections import Counter
from typing import Any

from tracer.probes.uprobes import Site, Uprobes
from tracer.probes.window import ProbeWindow

# the entry handlers of the probes put in the window (their return probes go with them)
LOOKUP_HANDLERS = frozenset({"tt_kernel_get_function"})


class AliasLookups:
    """The window of the driver's alias look-up probes."""

    def __init__(self, bpf: Any, errors: dict[str, str], uprobes: Uprobes | None,
                 quiet_s: float = 5.0) -> None:
        """``quiet_s`` 0: the look-up probes stay attached all along."""
        self.bpf = bpf
        self.window = ProbeWindow(uprobes, errors, "alias-lookups-off", self._read_calls,
                                  quiet_s, fires="alias look-ups", news="no new handle")
        self.opened: Counter[str] = Counter()  # why the window (re)opened

    def _read_calls(self) -> int:
        return int(sum(self.bpf[b"name_calls"][ctypes.c_int(0)]))

    @property
    def open(self) -> bool:
        """Whether the look-up probes are attached now."""
        return self.window.open

    def add_sites(self, sites: list[Site]) -> None:
        """One libcuda file's look-up probe sites: attached at once (a library just
        found may be resolving its kernels now)."""
        self.window.add_sites(sites)
        self.open_window("libcuda attached")

    def open_window(self, why: str) -> None:
        """Attach the look-up probes (again) and restart the quiet timer."""
        if self.window.open_window(why):
            self.opened[why] += 1

    def close_window(self, why: str) -> None:
        """Detach the look-up probes (in the background)."""
        self.window.close_window(why)

    def join_detach(self) -> None:
        """Wait for a detach under way."""
        self.window.join_detach()

    def on_name(self) -> None:
        """A name record came (the kernel sends one per new handle or alias)."""
        self.window.news()

    def tick(self, now: float) -> None:
        """Close the window once look-ups have gone quiet."""
        why = self.window.due(now)
        if why is not None:
            self.close_window(why)

    def state(self) -> dict[str, Any]:
        """What the window did, for reports and benchmarks."""
        return {**self.window.state(), "opened_for": dict(self.opened)}
