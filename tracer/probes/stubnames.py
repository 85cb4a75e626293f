"""Kernel names for handles resolved before the tracer attached, from the CUDA
runtime's host stubs (bpf/cuda.c, "kernel names from the runtime's host stubs").

While naming is open, uprobes on libcudart's launch calls tell the kernel which host
stub each thread is launching; the driver's launch probe pairs it with the handle and
sends one KSTUB record per process and handle. Here each stub address is symbolised in
its process (tracer/probes/symbols.py) and becomes an ordinary ``KernelName`` with
source NAME_HOST_STUB; a stub that cannot be named is counted (``stub_unresolved``)
and its handle stays unknown.

The runtime probes cost a uprobe trap per runtime launch while attached, so naming is a
window: it opens when a traced process with libcudart is found, and closes (the probes
detached) once runtime launches have gone on for ``quiet_s`` seconds with no new stub,
or after ``max_s`` seconds of runtime launches in all. Only time in which runtime
launches happened counts: an idle process costs nothing and shows nothing, so a server
attached while it waits for its first request keeps naming open for that request. A
newly traced process with libcudart opens the window again.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import Counter
from typing import Any

from tracer.events import wire
from tracer.events.gpu import KernelName, KernelStub
from tracer.probes import procfs
from tracer.probes.prenames import BackgroundPreNames
from tracer.probes.symbols import SymbolError, Symbolizer
from tracer.probes.uprobes import Attached, Site, Uprobes

C = wire.CONSTANTS
CHECK_S = 0.25  # how often the runtime's launch count is read while naming is open


class StubNames:
    """The runtime's launch probes (attached while the window is open) and the
    symbolising of the stubs they reveal."""

    def __init__(self, bpf: Any, errors: dict[str, str], uprobes: Uprobes | None,
                 quiet_s: float = 5.0, max_s: float = 60.0,
                 prenames: BackgroundPreNames | None = None) -> None:
        self.bpf = bpf
        self.prenames = prenames  # names from registration code, cubins, driver objects
        self.errors = errors
        self.uprobes = uprobes
        self._detacher: threading.Thread | None = None
        self.quiet_s = quiet_s
        self.max_s = max_s
        self.enabled = quiet_s > 0
        self.sites: dict[tuple[str, int], str] = {}  # (path, addr) -> BPF function
        self._groups: list[Attached] = []  # the probes attached in this window
        self.opened_at: float | None = None  # monotonic time; None while closed
        self.quiet_active = 0.0  # seconds with runtime launches since the last new stub
        self.open_active = 0.0  # seconds with runtime launches since the window opened
        self._calls = 0  # the kernel's stub_calls at the last check
        self._last_check = 0.0
        self.windows = 0  # times opened
        self.closed_why = ""
        self.symbolizer = Symbolizer()
        self.named = 0
        self.unresolved: Counter[str] = Counter()  # by reason (the error's first words)
        self.unresolved_examples: dict[str, str] = {}  # reason -> one full message
        self.symbolise_s = 0.0  # time spent reading symbols and maps
        self.driver_launches = 0  # handles first launched through the driver API (stub 0)
        self._pending: list[KernelStub] = []
        self._exited: set[int] = set()

    @property
    def attached(self) -> set[tuple[str, int]]:
        """(path, address) of the runtime's launch probes attached now."""
        return {(s.path, s.vaddr) for g in self._groups for s in g.sites}

    @property
    def open(self) -> bool:
        """Whether the runtime's launch probes are attached now."""
        return self.opened_at is not None

    def add_sites(self, path: str, sites: list[tuple[int, str]]) -> None:
        """Probe sites (ELF address, BPF function) of one libcudart file; attached at
        once if the window is open."""
        for addr, fn in sites:
            self.sites.setdefault((path, addr), fn)
        if self.open:
            self._attach_all()

    def open_window(self) -> None:
        """Attach the runtime's launch probes (again) and start the quiet timer."""
        if not self.enabled or not self.sites:
            return
        now = time.monotonic()
        if self.opened_at is None:
            self.opened_at = now
            self.windows += 1
            self.open_active = 0.0
            self._calls = self._read_calls()
            self._last_check = now
        self.quiet_active = 0.0
        self._attach_all()
        self._set_flag(1)

    def _attach_all(self) -> None:
        assert self.uprobes is not None
        self.join_detach()  # a window closed just before: its probes must be gone first
        attached = self.attached
        todo = [Site(path, addr, fn, name=f"{addr:#x} (stub naming)")
                for (path, addr), fn in self.sites.items() if (path, addr) not in attached]
        if todo:
            self._groups.append(self.uprobes.attach(todo, self.errors))

    def close_window(self, why: str) -> None:
        """Detach the runtime's launch probes; stubs already sent are still named."""
        if self.opened_at is None:
            return
        self._set_flag(0)  # launches stop pairing at once; the detach takes longer
        # calls caught mid-way are never to be paired: cleared once the probes are gone,
        # since until then each runtime launch still leaves one
        pending = self.bpf[b"stub_pending"]
        assert self.uprobes is not None
        groups, self._groups = self._groups, []
        self._detacher = self.uprobes.detach_in_background(
            groups, self.errors, "stub-naming-off", done=lambda _s: pending.clear())
        self.closed_why = why
        self.opened_at = None  # last: another thread reading state sees it all done

    def join_detach(self) -> None:
        """Wait for a detach under way (before re-attaching, or tearing down)."""
        if self._detacher is not None:
            self._detacher.join()
            self._detacher = None

    def _set_flag(self, on: int) -> None:
        self.bpf[b"config"][ctypes.c_int(C["CFG_STUB_NAMING"])] = ctypes.c_uint64(on)

    def _read_calls(self) -> int:
        return int(sum(self.bpf[b"stub_calls"][ctypes.c_int(0)]))

    def tick(self, now: float) -> None:
        """Close the window once naming has gone quiet, or has been busy too long."""
        if self.opened_at is None or now - self._last_check < CHECK_S:
            return
        calls = self._read_calls()
        if calls != self._calls:  # runtime launches happened since the last check
            busy = now - self._last_check
            self.quiet_active += busy
            self.open_active += busy
        self._calls, self._last_check = calls, now
        if self.quiet_active >= self.quiet_s:
            self.close_window(f"{self.quiet_s:g} s of runtime launches with no new host stub")
        elif self.max_s > 0 and self.open_active >= self.max_s:
            self.close_window(f"{self.max_s:g} s of runtime launches")

    # ---- stubs -> names ---------------------------------------------------------------

    def on_stub(self, ev: KernelStub) -> None:
        """A KSTUB record (from the ring-buffer callback): named at the next
        ``resolve``, outside the callback."""
        self._pending.append(ev)
        self.quiet_active = 0.0

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
        return {"enabled": self.enabled, "open": self.open, "windows": self.windows,
                "quiet_s": self.quiet_s, "max_s": self.max_s,
                "busy_s": round(self.open_active, 3),
                "closed_why": self.closed_why, "probe_sites": len(self.sites),
                "attached": len(self.attached), "named": self.named,
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
