"""Kernel names for handles resolved before the tracer attached, from the CUDA
runtime's host stubs (bpf/cuda.c, "kernel names from the runtime's host stubs").

While naming is open, uprobes on libcudart's launch calls tell the kernel which host
stub each thread is launching; the driver's launch probe pairs it with the handle and
sends one KSTUB record per process and handle. Here each stub address is symbolised in
its process (tracer/probes/symbols.py) and becomes an ordinary ``KernelName`` with
source NAME_HOST_STUB; a stub that cannot be named is counted (``stub_unresolved``)
and its handle stays unknown.

The runtime probes cost a uprobe trap per runtime launch while attached, so naming is a
window (tracer/probes/window.py): it opens when a traced process with libcudart is
found, and closes (the probes detached) once runtime launches have gone on for
``quiet_s`` seconds with no new stub, or after ``max_s`` seconds of runtime launches in
all. Only time in which runtime launches happened counts: an idle process costs nothing
and shows nothing, so a server attached while it waits for its first request keeps
naming open for that request. A newly traced process with libcudart opens the window
again.
"""

from __future__ import annotations

import ctypes
import time
from collections import Counter
from typing import Any

from tracer.events import wire
from tracer.events.gpu import KernelName, KernelStub
from tracer.probes import procfs
from tracer.probes.prenames import BackgroundPreNames
from tracer.probes.symbols import SymbolError, Symbolizer
from tracer.probes.uprobes import Site, Uprobes
from tracer.probes.window import ProbeWindow

C = wire.CONSTANTS


class StubNames:
    """The runtime's launch probes (attached while the window is open) and the
    symbolising of the stubs they reveal."""

    def __init__(self, bpf: Any, errors: dict[str, str], uprobes: Uprobes | None,
                 quiet_s: float = 5.0, max_s: float = 60.0,
                 prenames: BackgroundPreNames | None = None) -> None:
        self.bpf = bpf
        self.prenames = prenames  # names from registration code, cubins, driver objects
        self.errors = errors
        self.window = ProbeWindow(uprobes, errors, "stub-naming-off", self._read_calls,
                                  quiet_s, max_s, enabled=quiet_s > 0,
                                  fires="runtime launches", news="no new host stub")
        self.symbolizer = Symbolizer()
        self.named = 0
        self.unresolved: Counter[str] = Counter()  # by reason (the error's first words)
        self.unresolved_examples: dict[str, str] = {}  # reason -> one full message
        self.symbolise_s = 0.0  # time spent reading symbols and maps
        self.driver_launches = 0  # handles first launched through the driver API (stub 0)
        self._pending: list[KernelStub] = []
        self._exited: set[int] = set()

    @property
    def enabled(self) -> bool:
        """Whether host-stub naming is on at all (``quiet_s`` > 0)."""
        return self.window.enabled

    @property
    def attached(self) -> set[tuple[str, int]]:
        """(path, address) of the runtime's launch probes attached now."""
        return {(path, addr) for path, addr, _ret in self.window.attached}

    @property
    def open(self) -> bool:
        """Whether the runtime's launch probes are attached now."""
        return self.window.open

    @property
    def closed_why(self) -> str:
        """Why the window last closed."""
        return self.window.closed_why

    @property
    def sites(self) -> dict[tuple[str, int, bool], Site]:
        """Every runtime launch probe site known, attached or not."""
        return self.window.sites

    def add_sites(self, path: str, sites: list[tuple[int, str]]) -> None:
        """Probe sites (ELF address, BPF function) of one libcudart file; attached at
        once if the window is open."""
        self.window.add_sites([Site(path, addr, fn, name=f"{addr:#x} (stub naming)")
                               for addr, fn in sites])

    def open_window(self) -> None:
        """Attach the runtime's launch probes (again) and start the quiet timer."""
        self.window.open_window("a process with libcudart")
        if self.window.open:
            self._set_flag(1)

    def close_window(self, why: str) -> None:
        """Detach the runtime's launch probes; stubs already sent are still named."""
        if not self.window.open:
            return
        self._set_flag(0)  # launches stop pairing at once; the detach takes longer
        # calls caught mid-way are never to be paired: cleared once the probes are gone,
        # since until then each runtime launch still leaves one
        pending = self.bpf[b"stub_pending"]
        self.window.close_window(why, done=lambda _s: pending.clear())

    def join_detach(self) -> None:
        """Wait for a detach under way (before re-attaching, or tearing down)."""
        self.window.join_detach()

    def _set_flag(self, on: int) -> None:
        self.bpf[b"config"][ctypes.c_int(C["CFG_STUB_NAMING"])] = ctypes.c_uint64(on)

    def _read_calls(self) -> int:
        return int(sum(self.bpf[b"stub_calls"][ctypes.c_int(0)]))

    def tick(self, now: float) -> None:
        """Close the window once naming has gone quiet, or has been busy too long."""
        why = self.window.due(now)
        if why is not None:
            self.close_window(why)

    # ---- stubs -> names ---------------------------------------------------------------

    def on_stub(self, ev: KernelStub) -> None:
        """A KSTUB record (from the ring-buffer callback): named at the next
        ``resolve``, outside the callback."""
        self._pending.append(ev)
        self.window.news()

    def resolve(self) -> list[KernelName]:
        """Names for the stubs that arrived since the last call."""
        pending, self._pending = self._pending, []
        out = self.prenames.take() if self.prenames is not None else []
        if not pending:
            return out
        t0 = time.perf_counter()
        maps: dict[int, list[procfs.Mapping]] = {}
        for ev in pending:
            if ev.stub == 0 or ev.stub == ev.handle:
                # no host stub to symbolise: a driver-API launch, or (CUDA 13) the
                # runtime given the handle; named, if at all, from what the process's
                # memory holds (tracer/probes/prenames.py)
                if self.prenames is not None:
                    self.prenames.launched(ev.pid, ev.handle)
                if ev.stub == 0:
                    self.driver_launches += 1
                    continue
            if ev.stub == ev.handle:
                # The runtime was given the kernel handle itself (cudaKernel_t), not a
                # host stub: seen with PyTorch 2.11 + CUDA 13 on an H100, where every
                # launch's "func" equals the CUfunction the driver gets. No code
                # address, nothing to symbolise.
                why = "kernel_handle"
                self.unresolved[why] += 1
                self.unresolved_examples.setdefault(
                    why, f"pid {ev.pid}: the runtime launch got {ev.stub:#x}, the driver's "
                         "own kernel handle, not a host-stub address")
                continue
            if ev.pid not in maps:
                maps[ev.pid] = procfs.mappings(ev.pid)
            registered = (self.prenames.registered_name(ev.pid, ev.stub, maps[ev.pid])
                          if self.prenames is not None else None)
            if registered:
                # the device name the stub was registered with: exact, symbols or not
                # (a stub's own symbol can differ: internal-linkage stubs are "...L...")
                self.named += 1
                self.prenames.named(ev.pid, ev.handle, registered)  # type: ignore[union-attr]
                out.append(KernelName(pid=ev.pid, tid=ev.tid, ts=ev.ts,
                                      source=C["NAME_REGISTERED_STUB"], handle=ev.handle,
                                      alias_of=0, name=registered))
                continue
            try:
                sym = self.symbolizer.resolve(ev.pid, ev.stub, maps[ev.pid])
            except SymbolError as e:
                why = _reason(str(e))
                self.unresolved[why] += 1
                self.unresolved_examples.setdefault(why, str(e))
                continue
            self.named += 1
            if self.prenames is not None:
                self.prenames.named(ev.pid, ev.handle)
            out.append(KernelName(pid=ev.pid, tid=ev.tid, ts=ev.ts,
                                  source=C["NAME_HOST_STUB"], handle=ev.handle, alias_of=0,
                                  name=sym.name))
        self.symbolise_s += time.perf_counter() - t0
        return out

    def counters(self) -> dict[str, int]:
        """For the drop report: stubs that stayed unnamed (a kernel handle given to the
        runtime is no stub: whether it got a name is in the summary's kernel_names)."""
        return {"stub_unresolved": sum(n for why, n in self.unresolved.items()
                                       if why != "kernel_handle")}

    # ---- exited processes -------------------------------------------------------------

    def forget(self, pid: int) -> None:
        """``pid`` exited: its entries in the kernel's sent-set go at the next prune."""
        self._exited.add(pid)
        if self.prenames is not None:
            self.prenames.forget(pid)

    def prune(self) -> None:
        """Remove exited processes' (pid, handle) entries, so a reused pid is named
        afresh and the set does not fill up over a long run."""
        if not self._exited:
            return
        gone, self._exited = self._exited, set()
        table = self.bpf[b"stub_sent"]
        for k in [k for k in table.keys() if k.pid in gone]:
            try:
                del table[k]
            except KeyError:
                pass

    def state(self) -> dict[str, Any]:
        """What naming did, for reports and benchmarks."""
        return {**self.window.state(), "named": self.named,
                "unresolved": dict(self.unresolved),
                "unresolved_examples": dict(self.unresolved_examples),
                "files_read": self.symbolizer.parses,
                "symbolise_s": round(self.symbolise_s, 4),
                "driver_launches": self.driver_launches,
                "before_attach": self.prenames.state() if self.prenames is not None else None}


def _reason(message: str) -> str:
    """A short class for an unresolved stub's error, to count by."""
    for key, words in (("no_mapping", "in no file mapping"), ("not_executable", "not executable"),
                       ("no_symbol", "no function symbol"), ("ambiguous", "names start at"),
                       ("no_symbol_table", "no symbol table"), ("no_segment", "no PT_LOAD")):
        if words in message:
            return key
    return "unreadable"
