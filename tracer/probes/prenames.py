"""Names for kernel handles that a process resolved before the tracer attached.

The driver's name probes (bpf/cuda.c) see only what is resolved after attach, and on
CUDA 13 the runtime is given the kernel handle itself, not a host stub to symbolise
(tracer/probes/stubnames.py). What the process's own memory and files still say:

1. **Registration code** (``tracer/probes/regcode.py``): each library's
   ``__cudaRegisterFunction`` calls give every host stub's device name, and its CUDA 13
   ``__cudaGetKernel(&__handle, stub)`` calls the variable where each stub keeps its
   kernel's handle. Read at attach through ``/proc/PID/mem``, every filled variable
   names a handle (source NAME_STUB_SLOT); a host stub from a KSTUB record (CUDA 12
   launches) is named by its registration (NAME_REGISTERED_STUB), symbols or not.
2. **Cubins** (``tracer/probes/fatbin.py``): the kernel names in each mapped library's
   ``.nv_fatbin``, the evidence a name from memory must match, and the check on 1.
3. **Driver objects**: a handle is a pointer to the driver's own object, which leads to
   the kernel's name. Its layout is not documented, so it is learnt in each process
   from handles whose names are known by 1 or the live probes: a path (offsets to
   follow, then a string) is used only once it gave the right name for at least
   ``MIN_AGREE`` known handles and a wrong one for none, and a name it finds is taken
   only if it is a kernel name of the loaded cubins (NAME_DRIVER_OBJECT). This names
   kernels launched through the driver API whose handles were resolved before attach
   (cuBLAS, cuBLASLt: handles from ``cuLibraryGetKernel`` at their init).

Files are analysed once (cached by device, inode, size and mtime); per process the cost
is one read of the handle variables per library, and a few reads per unknown handle
once a path is learnt. Nothing is guessed: what does not agree is counted and left
unnamed.
"""

from __future__ import annotations

import os
import queue
import struct
import threading
import time
from bisect import bisect_right
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from tracer.events import wire
from tracer.events.gpu import NAME_SOURCES, KernelName
from tracer.probes import procfs
from tracer.probes.fatbin import FatbinNames, read_fatbin
from tracer.probes.libstrings import LibraryStrings
from tracer.probes.regcode import (GET_KERNEL, REGISTER, Registration, RegcodeError,
                                   read_registration)

C = wire.CONSTANTS
MIN_AGREE = 3  # known handles a driver-object path must name right before it is used
MAX_REFERENCES = 16  # known handles explored to learn the paths
OBJECT_BYTES = 512  # bytes of a driver object searched for pointers and strings
MAX_NAME = 4096
TRITON_REREAD_S = 10.0  # a Triton cache is read again at most this often, when needed
_U64 = struct.Struct("<Q")
_SPAN = 1 << 20  # handle variables closer than this are read in one go


@dataclass
class LibraryEvidence:
    """What one library file says about its kernels."""

    path: str
    registration: Registration | None = None
    fatbin: FatbinNames | None = None
    error: str = ""
    seconds: float = 0.0

    @property
    def kernel_names(self) -> set[str]:
        """The kernel names of its cubins (empty where they could not be read)."""
        return self.fatbin.names if self.fatbin is not None else set()

    def summary(self) -> dict[str, Any]:
        """For reports and benchmarks."""
        return {"path": self.path, "seconds": round(self.seconds, 3), "error": self.error,
                "registration": self.registration.summary() if self.registration else None,
                "fatbin": self.fatbin.summary() if self.fatbin else None}


class ProcessMemory:
    """Reads another process's memory (``/proc/PID/mem``); a failed read gives b"".

    Reads are limited to the readable mappings of ``/proc/PID/maps`` as read at
    creation. With ``refresh_s``, an address outside them has the mappings read again
    (at most once per ``refresh_s``): memory the process mapped since (new allocator
    arenas, a grown heap) becomes readable for a reader that lives as long as the
    process."""

    def __init__(self, pid: int, refresh_s: float | None = None) -> None:
        self.pid = pid
        self.reads = 0
        self.bytes = 0
        self.refreshes = 0
        self.refresh_s = refresh_s
        try:
            self._fd: int | None = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        except OSError:
            self._fd = None
        self._load_ranges()

    def _load_ranges(self) -> None:
        self.ranges = _readable_ranges(self.pid)
        self._starts = [lo for lo, _hi in self.ranges]
        self._loaded = time.monotonic()

    def _end_of(self, addr: int) -> int:
        """The end of the readable mapping holding ``addr`` (0: none)."""
        i = bisect_right(self._starts, addr) - 1
        if i >= 0 and addr < self.ranges[i][1]:
            return self.ranges[i][1]
        if (self.refresh_s is not None and self._fd is not None and addr > 0
                and time.monotonic() - self._loaded >= self.refresh_s):
            self.refreshes += 1
            self._load_ranges()
            i = bisect_right(self._starts, addr) - 1
            if i >= 0 and addr < self.ranges[i][1]:
                return self.ranges[i][1]
        return 0

    def readable(self, addr: int, n: int = 8) -> bool:
        """Whether [addr, addr + n) lies in one readable mapping."""
        return addr + n <= self._end_of(addr)

    def read(self, addr: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``addr``, cut at the end of its mapping."""
        end = self._end_of(addr)
        if self._fd is None or not end:
            return b""
        n = min(n, end - addr)
        self.reads += 1
        try:
            data = os.pread(self._fd, n, addr)
        except OSError:
            return b""
        self.bytes += len(data)
        return data

    def string(self, addr: int) -> str | None:
        """The NUL-terminated printable ASCII string at ``addr`` (at most MAX_NAME
        bytes), or None."""
        out = b""
        while len(out) < MAX_NAME:
            chunk = self.read(addr + len(out), 256)
            if not chunk:
                return None
            end = chunk.find(b"\0")
            out += chunk if end < 0 else chunk[:end]
            if end >= 0:
                break
        else:
            return None
        if len(out) < 2 or not all(0x21 <= b < 0x7F for b in out):
            return None
        return out.decode("ascii")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _readable_ranges(pid: int) -> list[tuple[int, int]]:
    out = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                cols = line.split(None, 2)
                if len(cols) >= 2 and cols[1].startswith("r"):
                    lo, hi = cols[0].split("-")
                    out.append((int(lo, 16), int(hi, 16)))
    except OSError:
        pass
    return sorted(out)


def _looks_like_name(b: bytes) -> bool:
    return len(b) >= 2 and (b[0] == 0x5F or 0x41 <= b[0] <= 0x5A or 0x61 <= b[0] <= 0x7A)


@dataclass
class _Process:
    """What is known about one traced process."""

    pid: int
    files: set[tuple[int, int, int, int]] = field(default_factory=set)  # analysed
    kernel_names: set[str] = field(default_factory=set)  # of its libraries' cubins
    references: dict[int, str] = field(default_factory=dict)  # handle -> name known
    named: set[int] = field(default_factory=set)  # handles named by any route
    pending: set[int] = field(default_factory=set)  # unknown handles to try
    tried: set[int] = field(default_factory=set)
    triton_read: float = 0.0  # when its Triton caches were last read (monotonic)
    paths: list[tuple[int, ...]] | None = None  # learnt driver-object paths
    learnt_from: int = 0  # references the paths were learnt with
    path_stats: dict[str, Any] = field(default_factory=dict)
    libraries: list[str] = field(default_factory=list)  # its CUDA libraries (opened paths)
    # libraries with handle variables, to read again when unnamed handles turn up
    slot_libs: list[tuple[LibraryEvidence, list[procfs.Mapping]]] = field(default_factory=list)


def device_arch() -> int | None:
    """The first GPU's compute capability as a cubin's arch (9.0 -> 90), from NVML; None
    where there is none."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(
                pynvml.nvmlDeviceGetHandleByIndex(0))
        finally:
            pynvml.nvmlShutdown()
        return int(major) * 10 + int(minor)
    except Exception:  # no NVML, no driver, no GPU: every cubin is read instead
        return None


class PreNames:
    """Kernel names for handles resolved before attach (see the module docstring).
    ``arch``: the GPU's (e.g. 90), whose cubins are read; None reads every cubin (names
    can differ between architectures: 21,117 in the first cubin of each container of
    libtorch_cuda.so, 21,132 in its sm_90 ones and in all)."""

    def __init__(self, arch: int | None = None, object_naming: bool = True,
                 max_files: int = 64) -> None:
        self.arch = arch
        self.object_naming = object_naming
        self.max_files = max_files
        self._files: OrderedDict[tuple[int, int, int, int], LibraryEvidence] = OrderedDict()
        # files with no CUDA code (most of what a Python process maps): kept apart, so
        # that they never push a library's evidence out of the cache
        self._plain: set[tuple[int, int, int, int]] = set()
        self._procs: dict[int, _Process] = {}
        self._libstrings: OrderedDict[str, LibraryStrings] = OrderedDict()
        self.counts: Counter[str] = Counter()  # named by route, and why not
        self.examples: dict[str, str] = {}
        self.analyse_s = 0.0  # files
        self.read_s = 0.0  # process memory
        self.memory_reads = 0
        self.memory_bytes = 0

    # ---- files ---------------------------------------------------------------------

    def evidence(self, path: str, analyse: bool = True) -> LibraryEvidence | None:
        """The (cached) evidence of the file at ``path``; None if it has no CUDA
        kernels or registration code (or, without ``analyse``, was not analysed)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if key in self._files:
            self._files.move_to_end(key)
            return self._files[key]
        if key in self._plain or not analyse:
            return None
        t0 = time.perf_counter()
        ev = _analyse(path, self.arch)
        self.analyse_s += time.perf_counter() - t0
        if ev is None:
            if len(self._plain) > 65536:
                self._plain.clear()
            self._plain.add(key)
            return None
        ev.seconds = time.perf_counter() - t0
        self._files[key] = ev
        while len(self._files) > self.max_files:
            self._files.popitem(last=False)
        return ev

    def _strings(self, path: str) -> LibraryStrings:
        ls = self._libstrings.get(path)
        if ls is None:
            ls = self._libstrings[path] = LibraryStrings(path)
            while len(self._libstrings) > self.max_files:
                self._libstrings.popitem(last=False)
        return ls

    def libraries(self) -> list[dict[str, Any]]:
        """The analysed CUDA libraries, what each holds and what it cost."""
        return [ev.summary() for ev in self._files.values()]

    # ---- processes -----------------------------------------------------------------

    def _proc(self, pid: int) -> _Process:
        p = self._procs.get(pid)
        if p is None:
            p = self._procs[pid] = _Process(pid)
        return p

    def scan(self, pid: int) -> list[KernelName]:
        """Analyse the CUDA libraries ``pid`` maps that are new to it, and name the
        handles their handle variables hold now. Call after the driver's name probes
        are attached: a kernel resolved from then on is named live."""
        p = self._proc(pid)
        out: list[KernelName] = []
        if not p.triton_read:
            self._add_triton(p)
        by_path: dict[str, list[procfs.Mapping]] = {}
        for m in procfs.mappings(pid):
            by_path.setdefault(m.path, []).append(m)
        for path, maps in by_path.items():
            if not any("x" in m.perms for m in maps):
                continue
            opened = procfs.open_mapped(pid, maps[0])
            try:
                st = os.stat(opened)
            except OSError:
                continue
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if key in p.files:
                continue
            p.files.add(key)
            ev = self.evidence(opened)
            if ev is None:
                continue
            p.kernel_names |= ev.kernel_names
            p.libraries.append(opened)
            if ev.registration is not None and ev.registration.slots:
                p.slot_libs.append((ev, maps))
                t0 = time.perf_counter()
                out += self._read_slots(p, ev, maps)
                self.read_s += time.perf_counter() - t0
        return out

    def rescan(self, pid: int, unnamed: Iterable[int]) -> list[KernelName]:
        """``unnamed``: handles ``pid`` launched that have no name. A kernel first
        launched after attach once naming had closed filled its handle variable then:
        the variables are read again and the handles they now hold named (each only
        once); the rest go to the driver-object route."""
        p = self._proc(pid)
        todo = {h for h in unnamed if h and h not in p.named}
        if not todo:
            return []
        self.counts["stub_slot: rereads"] += 1
        out: list[KernelName] = []
        t0 = time.perf_counter()
        for ev, maps in p.slot_libs:
            out += self._read_slots(p, ev, maps)
        self.read_s += time.perf_counter() - t0
        self.counts["stub_slot: named by a reread"] += sum(n.handle in todo for n in out)
        for h in todo - p.named:
            self.on_launched(pid, h)
        return out + (self.resolve() if self.object_naming else [])

    def _add_triton(self, p: _Process) -> None:
        t0 = time.perf_counter()
        names, read = triton_cache_names(p.pid)
        p.kernel_names |= names
        p.triton_read = time.monotonic()
        self.counts["triton cubins read"] += read
        self.analyse_s += time.perf_counter() - t0

    def _read_slots(self, p: _Process, ev: LibraryEvidence,
                    maps: list[procfs.Mapping]) -> list[KernelName]:
        reg = ev.registration
        assert reg is not None
        bias = None
        for m in maps:
            vaddr = reg.vaddr_of(m.offset)
            if vaddr is not None:
                bias = m.start - vaddr
                break
        if bias is None:
            self._count("stub_slot: library not mapped where its segments say", ev.path)
            return []
        names = reg.slot_names()
        known = ev.kernel_names
        mem = ProcessMemory(p.pid)
        try:
            values = _read_u64s(mem, bias, sorted(names))
        finally:
            self.memory_reads += mem.reads
            self.memory_bytes += mem.bytes
            mem.close()
        by_handle: dict[int, set[str]] = {}
        unread = 0
        for slot, handle in values.items():
            if handle is None:
                unread += 1
            elif handle == 0:
                pass  # that kernel was never launched (a live probe names it if it is)
            elif known and names[slot] not in known:
                self._count("stub_slot: name not in the library's cubins", names[slot])
            else:
                by_handle.setdefault(handle, set()).add(names[slot])
        self.counts["stub_slot: variables read"] += len(values) - unread
        if unread:
            self._count("stub_slot: libraries not readable", f"pid {p.pid}: {ev.path}")
        out = []
        ts = time.monotonic_ns()
        for handle, got in by_handle.items():
            if handle in p.named:
                continue  # named already (at attach, or live): once is enough
            if len(got) != 1:
                self._count("stub_slot: one handle, several names", ", ".join(sorted(got)))
                continue
            name = next(iter(got))
            p.references[handle] = name
            p.named.add(handle)
            p.pending.discard(handle)
            self.counts["stub_slot"] += 1
            out.append(KernelName(pid=p.pid, tid=p.pid, ts=ts, source=C["NAME_STUB_SLOT"],
                                  handle=handle, alias_of=0, name=name))
        return out

    def registered_name(self, pid: int, stub: int, maps: list[procfs.Mapping],
                        analyse: bool = True) -> str | None:
        """The device name that registration code gives the host stub at ``stub`` in
        ``pid`` (CUDA 12 launches pass the stub), or None. With ``analyse`` False only
        a library analysed before is looked at."""
        for m in maps:
            if m.start <= stub < m.end:
                break
        else:
            return None
        ev = self.evidence(procfs.open_mapped(pid, m), analyse)
        if ev is None or ev.registration is None:
            return None
        vaddr = ev.registration.vaddr_of(stub - m.start + m.offset)
        name = ev.registration.names.get(vaddr) if vaddr is not None else None
        if name and ev.kernel_names and name not in ev.kernel_names:
            self._count("registered_stub: name not in the library's cubins", name)
            return None
        return name

    def on_live_name(self, pid: int, handle: int, name: str) -> None:
        """A name the driver's probes saw (a reference for learning driver objects)."""
        p = self._proc(pid)
        if name:
            p.references[handle] = name
        p.named.add(handle)
        p.pending.discard(handle)

    def on_named(self, pid: int, handle: int, name: str = "") -> None:
        """``handle`` got a name by another route; ``name`` if it is the device name
        (a reference for learning driver objects)."""
        p = self._proc(pid)
        if name:
            p.references[handle] = name
        p.named.add(handle)
        p.pending.discard(handle)

    def on_launched(self, pid: int, handle: int) -> None:
        """A launched handle no name probe saw: try its driver object at ``resolve``."""
        if not self.object_naming or not handle:
            return
        p = self._proc(pid)
        if handle not in p.named and handle not in p.tried:
            p.pending.add(handle)

    def forget(self, pid: int) -> None:
        """``pid`` exited."""
        self._procs.pop(pid, None)

    # ---- driver objects ------------------------------------------------------------

    def resolve(self) -> list[KernelName]:
        """Names from driver objects for the launched handles still unknown."""
        out: list[KernelName] = []
        for p in self._procs.values():
            if not p.pending:
                continue
            t0 = time.perf_counter()
            mem = ProcessMemory(p.pid)
            try:
                out += self._resolve_process(p, mem)
            finally:
                self.memory_reads += mem.reads
                self.memory_bytes += mem.bytes
                mem.close()
                self.read_s += time.perf_counter() - t0
        return out

    def _resolve_process(self, p: _Process, mem: ProcessMemory) -> list[KernelName]:
        if p.paths is None or (not p.paths and len(p.references) > p.learnt_from):
            self._learn(p, mem)
        pending, p.pending = p.pending, set()
        out = []
        ts = time.monotonic_ns()
        for handle in sorted(pending):
            p.tried.add(handle)
            if not p.paths:
                self.counts["driver_object: no verified layout"] += 1
                continue
            found = {s for s in (_follow(mem, handle, path) for path in p.paths) if s}
            good = {s for s in found if s in p.kernel_names}
            if found and not good and time.monotonic() - p.triton_read > TRITON_REREAD_S:
                self._add_triton(p)  # a Triton kernel compiled since attach: cached now
                good = {s for s in found if s in p.kernel_names}
            source = C["NAME_DRIVER_OBJECT"]
            if found and not good:
                # in no cubin (cuBLASLt builds some kernels' names at run time): a
                # string of one of the process's CUDA libraries may still confirm it
                good = {s for s in found if any(self._strings(lib).holds(s)
                                                for lib in p.libraries)}
                source = C["NAME_DRIVER_STRING"]
            if len(good) == 1:
                name = good.pop()
                p.named.add(handle)
                self.counts[NAME_SOURCES[source]] += 1
                out.append(KernelName(pid=p.pid, tid=p.pid, ts=ts, source=source,
                                      handle=handle, alias_of=0, name=name))
            elif len(good) > 1:
                self._count("driver_object: paths disagree", ", ".join(sorted(good)))
            elif found:
                self._count("driver_object: string in no cubin or library string",
                            sorted(found)[0])
            else:
                self.counts["driver_object: nothing found"] += 1
        return out

    def _learn(self, p: _Process, mem: ProcessMemory) -> None:
        """The paths that name every explored known handle right, and none wrong."""
        refs = sorted(p.references.items())[:MAX_REFERENCES]
        p.learnt_from = len(p.references)
        agree: Counter[tuple[int, ...]] = Counter()
        wrong: Counter[tuple[int, ...]] = Counter()
        all_names = set(p.references.values()) | p.kernel_names
        for handle, name in refs:
            for path, s in explore(mem, handle).items():
                if s == name:
                    agree[path] += 1
                elif s in all_names:
                    wrong[path] += 1
        p.paths = sorted((path for path, n in agree.items()
                          if n >= MIN_AGREE and not wrong[path]),
                         key=lambda path: (-agree[path], len(path), path))[:4]
        p.path_stats = {"references": len(refs),
                        "paths": [{"path": list(path), "agree": agree[path]}
                                  for path in p.paths],
                        "rejected": [{"path": list(path), "agree": agree[path],
                                      "wrong": wrong[path]}
                                     for path, _n in (agree + wrong).most_common(6)
                                     if path not in p.paths]}

    # ---- reporting -----------------------------------------------------------------

    def _count(self, why: str, example: str) -> None:
        self.counts[why] += 1
        self.examples.setdefault(why, example[:300])

    def state(self) -> dict[str, Any]:
        """What naming before attach did and cost, for reports and benchmarks."""
        return {"counts": dict(self.counts), "examples": dict(self.examples),
                "analyse_s": round(self.analyse_s, 3), "read_s": round(self.read_s, 3),
                "memory_reads": self.memory_reads, "memory_bytes": self.memory_bytes,
                "libraries": self.libraries(),
                "layouts": {str(pid): p.path_stats for pid, p in self._procs.items()
                            if p.path_stats}}


def explore(mem: ProcessMemory, handle: int) -> dict[tuple[int, ...], str]:
    """Every string (that could be a name) reachable from the object at ``handle``:
    inline in it, pointed to by one of its words, or by a word of an object one of its
    words points to; path -> string. A path is offsets: each but the last is a pointer
    to follow, the last where the string starts (see ``_follow``)."""
    out: dict[tuple[int, ...], str] = {}
    top = mem.read(handle, OBJECT_BYTES)
    _strings_in(mem, handle, top, (), out)
    seen: set[int] = set()
    for o1 in range(0, len(top) - 7, 8):
        p1 = _U64.unpack_from(top, o1)[0]
        if p1 in seen or not mem.readable(p1):
            continue
        seen.add(p1)
        obj = mem.read(p1, OBJECT_BYTES)
        _strings_in(mem, p1, obj, (o1,), out)
        for o2 in range(0, len(obj) - 7, 8):
            p2 = _U64.unpack_from(obj, o2)[0]
            if mem.readable(p2) and _looks_like_name(mem.read(p2, 2)):
                s = mem.string(p2)
                if s:
                    out.setdefault((o1, o2, 0), s)
    return out


def _strings_in(mem: ProcessMemory, base: int, obj: bytes, prefix: tuple[int, ...],
                out: dict[tuple[int, ...], str]) -> None:
    """Strings starting at an 8-byte boundary of ``obj`` (read at ``base``)."""
    for s in range(0, len(obj) - 1, 8):
        # a string starts the object or follows a NUL (not the tail of a longer one)
        if _looks_like_name(obj[s:s + 2]) and (s == 0 or obj[s - 1] == 0):
            got = mem.string(base + s) if obj.find(b"\0", s) < 0 else _ascii(obj, s)
            if got:
                out.setdefault((*prefix, s), got)


def _ascii(obj: bytes, s: int) -> str | None:
    raw = obj[s:obj.find(b"\0", s)]
    if len(raw) < 2 or not all(0x21 <= b < 0x7F for b in raw):
        return None
    return raw.decode("ascii")


def _follow(mem: ProcessMemory, handle: int, path: tuple[int, ...]) -> str | None:
    """The string at the end of ``path`` from ``handle``, or None."""
    base = handle
    for off in path[:-1]:
        raw = mem.read(base + off, 8)
        if len(raw) != 8:
            return None
        base = _U64.unpack(raw)[0]
    return mem.string(base + path[-1])


def _read_u64s(mem: ProcessMemory, bias: int, vaddrs: list[int]) -> dict[int, int | None]:
    """The 8-byte values at ``vaddrs`` (sorted ELF addresses) + ``bias``; spans of
    nearby variables are read in one go."""
    out: dict[int, int | None] = {}
    i = 0
    while i < len(vaddrs):
        j = i
        while j + 1 < len(vaddrs) and vaddrs[j + 1] - vaddrs[i] < _SPAN:
            j += 1
        lo = vaddrs[i]
        data = mem.read(bias + lo, vaddrs[j] + 8 - lo)
        for v in vaddrs[i:j + 1]:
            at = v - lo
            out[v] = _U64.unpack_from(data, at)[0] if at + 8 <= len(data) else None
        i = j + 1
    return out


MAX_TRITON_CUBINS = 20000


def triton_cache_names(pid: int) -> tuple[set[str], int]:
    """(kernel names, cubins read) of the cubins in ``pid``'s Triton caches: Triton
    loads its kernels from there (``cuModuleLoadData``), not from a mapped library.
    Looked for where Triton and PyTorch's inductor put them: ``$TRITON_CACHE_DIR``
    (the process's environment at exec), ``$HOME/.triton/cache`` and
    ``/tmp/torchinductor_*/triton``, seen through the process's root."""
    from tracer.probes.fatbin import FatbinError, cubin_kernels

    root = f"/proc/{pid}/root"
    env: dict[str, str] = {}
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                k, _, v = item.partition(b"=")
                env[k.decode(errors="replace")] = v.decode(errors="replace")
    except OSError:
        pass
    dirs = [env[k] for k in ("TRITON_CACHE_DIR",) if env.get(k)]
    if env.get("HOME"):
        dirs.append(os.path.join(env["HOME"], ".triton", "cache"))
    try:
        dirs += [os.path.join("/tmp", d, "triton") for d in os.listdir(root + "/tmp")
                 if d.startswith("torchinductor_")]
    except OSError:
        pass
    names: set[str] = set()
    read = 0
    for d in dirs:
        for top, _sub, files in os.walk(root + d):
            for fn in files:
                if not fn.endswith(".cubin") or read >= MAX_TRITON_CUBINS:
                    continue
                read += 1
                try:
                    with open(os.path.join(top, fn), "rb") as f:
                        names |= cubin_kernels(f.read())
                except (OSError, FatbinError, struct.error, IndexError):
                    continue
    return names, read


def _analyse(path: str, arch: int | None) -> LibraryEvidence | None:
    """Registration code and cubins of one file; None where it has neither."""
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            has_fatbin = elf.get_section_by_name(".nv_fatbin") is not None
            dynstr = elf.get_section_by_name(".dynstr")
            strings = dynstr.data() if dynstr is not None else b""
    except (OSError, ELFError, struct.error):
        return None
    registers = (REGISTER.encode() + b"\0" in strings or GET_KERNEL.encode() + b"\0" in strings)
    if not has_fatbin and not registers:
        return None
    ev = LibraryEvidence(path)
    try:
        ev.registration = read_registration(path)
    except (OSError, RegcodeError) as e:
        ev.error = f"registration code: {e}"
    if has_fatbin:
        try:
            ev.fatbin = read_fatbin(path, arch, every_cubin=arch is None)
        except OSError as e:
            ev.error = f"fatbin: {e}"
    return ev


class BackgroundPreNames:
    """``PreNames`` on a thread of its own, so that the agent keeps draining the ring
    buffer while a library is analysed (about 2 s for libtorch_cuda.so). Calls from
    the agent's loop only queue work; ``take`` hands over the names found since."""

    def __init__(self, names: PreNames) -> None:
        self.names = names
        self._lock = threading.Lock()  # PreNames is used from both threads
        self._work: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._out: list[KernelName] = []
        self._busy = 0
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tt-prenames", daemon=True)
        self._thread.start()

    def _put(self, *item: Any) -> None:
        with self._idle:
            self._busy += 1
        self._work.put(item)

    def scan(self, pid: int) -> None:
        """Analyse ``pid``'s CUDA libraries and name its handle variables."""
        self._put("scan", pid)

    def launched(self, pid: int, handle: int) -> None:
        """A launched handle with no name yet: try its driver object."""
        self._put("launched", pid, handle)

    def named(self, pid: int, handle: int, name: str = "") -> None:
        """``handle`` was named by another route (``name``: its exact device name)."""
        self._put("named", pid, handle, name)

    def live(self, pid: int, handle: int, name: str) -> None:
        """A name the driver's probes saw."""
        self._put("live", pid, handle, name)

    def unnamed(self, pid: int, handles: Iterable[int]) -> None:
        """Handles ``pid`` launched that still have no name (``PreNames.rescan``)."""
        self._put("unnamed", pid, tuple(handles))

    def forget(self, pid: int) -> None:
        """``pid`` exited."""
        self._put("forget", pid)

    def registered_name(self, pid: int, stub: int, maps: list[procfs.Mapping]) -> str | None:
        """``PreNames.registered_name`` where the stub's library is analysed already;
        None (the caller symbolises the stub) while it is not."""
        with self._lock:
            return self.names.registered_name(pid, stub, maps, analyse=False)

    def take(self) -> list[KernelName]:
        """The names found since the last call."""
        with self._lock:
            out, self._out = self._out, []
        return out

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until every queued call is done (tests, benchmarks); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def state(self) -> dict[str, Any]:
        """``PreNames.state``."""
        with self._lock:
            return self.names.state()

    def _run(self) -> None:
        while True:
            item = self._work.get()
            try:
                with self._lock:
                    got = self._do(item)
                    self._out += got
            except Exception as e:  # never let one process's oddity stop naming
                with self._lock:
                    self.names._count("error", f"{item[0]}: {e!r}")
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    def _do(self, item: tuple[Any, ...]) -> list[KernelName]:
        op = item[0]
        n = self.names
        if op == "scan":
            return n.scan(item[1])
        if op == "launched":
            n.on_launched(item[1], item[2])
            # several launches arrive together: name them in one pass
            return n.resolve() if self._work.empty() else []
        if op == "unnamed":
            return n.rescan(item[1], item[2])
        if op == "named":
            n.on_named(item[1], item[2], item[3])
        elif op == "live":
            n.on_live_name(item[1], item[2], item[3])
        elif op == "forget":
            n.forget(item[1])
        return n.resolve() if op != "forget" and self._work.empty() else []
