"""The user-space half of the launch-site stack sampler (bpf/stacks.c).

``StackSampler`` configures the sampler, has each traced process's Python interpreter
found (``pystacks``) and writes its layout into the kernel's ``py_procs`` map, and has
each new stack (a STACKDEF record: Python code objects, registers and a slice of the
user stack) turned into a ``StackFrames`` event: Python frames named from the process's
memory (``pycode``), native frames unwound with ``.eh_frame`` (``unwind``) and named
from the ELF symbol tables, down to the interpreter. Raw stack memory never leaves this
module: captures keep the ``StackFrames`` event.

Everything that reads a traced process's files or memory runs on the resolver's thread
(``StackResolver``), never on the thread that consumes the ring buffer: parsing a large
static interpreter's symbol tables takes seconds, and what a traced process maps is
not trusted (any failure to read it is that process's "no Python frames", with the
reason). Only the BPF maps are written by the polling thread (``take``), which applies
what the resolver found.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from tracer.events import schema
from tracer.events.stacks import StackDef, StackFrames
from tracer.probes import procfs
from tracer.probes.pycode import CodeReader
from tracer.probes.pystacks import PyLayout, PyLayoutError, find_interpreter, thread_map
from tracer.probes.cxxnames import native_name
from tracer.probes.symbols import ElfFunctions, SymbolError, Symbolizer
from tracer.probes.unwind import Region, Unwinder

DEFAULT_EVERY = 64  # mean GPU calls between a thread's samples (see docs/flame.md)
SCAN_TRIES = 5  # a process whose interpreter is not ready yet is looked at again
THREADS_EVERY_S = 5.0  # a Python process's thread states are mapped for the kernel this often
MAX_QUEUED_DEFS = 1024  # stack definitions (16 KiB each) waiting for the resolver; more: dropped
DEFS_BUDGET = 4096  # stack definitions a process sends at most (bpf/stacks.c; HF serve: ~120)
COUNTER_NAMES = ("stack_samples", "stack_samples_new_site", "stack_defs", "stack_defs_lost",
                 "stack_py_no_thread", "stack_py_truncated", "stack_slots_sent_early",
                 "stack_maps_full", "stack_defs_over_budget")


class StackSampler:
    """Configures bpf/stacks.c and resolves the stacks it finds."""

    def __init__(self, bpf: Any, every: int = DEFAULT_EVERY, jitter: bool = True,
                 slice_bytes: int = 16384, defs_budget: int = DEFS_BUDGET) -> None:
        from tracer.events import wire

        self.bpf = bpf
        cfg = bpf[b"stk_config"]
        cfg[ctypes.c_int(0)] = ctypes.c_uint64(max(1, every))
        cfg[ctypes.c_int(1)] = ctypes.c_uint64(1 if jitter else 0)
        cfg[ctypes.c_int(2)] = ctypes.c_uint64(
            max(0, min(slice_bytes, wire.CONSTANTS["STACK_SLICE"])) // 1024 * 1024)
        self.set_budget(defs_budget)
        self.enable(True)
        self.every = every
        self.layouts: dict[int, PyLayout] = {}
        self.why_not: dict[int, str] = {}  # pid -> why it has no Python frames
        self._tries: Counter[int] = Counter()
        self._scanning: dict[int, int] = {}  # pid -> generation of the scan under way
        self._generation = 0
        self._next_threads: dict[int, float] = {}  # pid -> when to map its threads again
        self.resolver = StackResolver()

    def set_budget(self, defs: int) -> None:
        """Stack definitions each process sends at most (0: no limit): a process that
        makes ever new stacks (random kernel handles) costs the agent at most this many
        resolved stacks; its further new stacks are counted (stack_defs_over_budget)."""
        self.bpf[b"stk_config"][ctypes.c_int(4)] = ctypes.c_uint64(max(0, defs))

    def enable(self, on: bool) -> None:
        """Pause or resume sampling (the benchmark's alternating windows); while paused
        a GPU call pays one array read."""
        self.bpf[b"stk_config"][ctypes.c_int(3)] = ctypes.c_uint64(1 if on else 0)
        self.on = on

    # ---- processes ---------------------------------------------------------------------

    def scan(self, pid: int) -> None:
        """Have ``pid``'s interpreter found (once; a few times while it is not ready),
        and then its threads mapped to their thread states every THREADS_EVERY_S, on the
        resolver's thread; ``take`` applies the results."""
        if pid in self.layouts:
            now = time.monotonic()
            if now >= self._next_threads.get(pid, 0.0):
                self._next_threads[pid] = now + THREADS_EVERY_S
                self.resolver.threads(pid, self._scanning.get(pid, 0))
            return
        if pid in self._scanning or self._tries[pid] >= SCAN_TRIES:
            return
        self._tries[pid] += 1
        self._generation += 1
        self._scanning[pid] = self._generation
        self.resolver.scan(pid, self._generation)

    def settle(self, timeout: float) -> None:
        """Wait (at most ``timeout``) for the scans under way, and apply them: at start,
        before the ring buffer is polled, so the processes traced from the start have
        Python frames from their first sampled call."""
        self.resolver.wait_idle(timeout)
        for found in self.resolver.found():
            self._apply(found)

    def _apply(self, found: "Found") -> None:
        """A scan's result, if it is still wanted: the thread states into
        ``stk_tstate``, the layout into ``py_procs``."""
        if found.layout is None and found.why == THREADS_ONLY:
            if found.pid in self.layouts:
                self._write_threads(found.threads)
            return
        if self._scanning.get(found.pid) != found.generation:
            return  # the process exited (or exec'd) since
        del self._scanning[found.pid]
        if found.layout is None:
            self.why_not[found.pid] = found.why
            return
        self._write_threads(found.threads)
        self._next_threads[found.pid] = time.monotonic() + THREADS_EVERY_S
        leaf = self.bpf[b"py_procs"].Leaf()
        for name, value in found.layout.bpf_fields().items():
            setattr(leaf, name, value)
        try:
            self.bpf[b"py_procs"][ctypes.c_uint32(found.pid)] = leaf
        except Exception as e:  # a full map: the process gets native frames only
            self.why_not[found.pid] = f"py_procs map: {e}"
            return
        self.why_not.pop(found.pid, None)
        self.layouts[found.pid] = found.layout

    def _write_threads(self, threads: dict[int, int]) -> None:
        """Thread id -> thread state entries for the kernel (bpf/stacks.c checks each
        at use): threads its own bounded walk of the newest states does not reach."""
        table = self.bpf[b"stk_tstate"]
        for tid, ts in threads.items():
            try:
                table[ctypes.c_uint32(tid)] = ctypes.c_uint64(ts)
            except Exception:  # an LRU map does not fill; anything else: the walk's
                break

    def forget(self, pid: int) -> None:
        """``pid`` exited (or exec'd another program: looked at afresh)."""
        self.layouts.pop(pid, None)
        self._next_threads.pop(pid, None)
        self._tries.pop(pid, None)
        self._scanning.pop(pid, None)
        self.why_not.pop(pid, None)
        for table in (b"py_procs", b"stk_defs_sent"):
            try:
                del self.bpf[table][ctypes.c_uint32(pid)]
            except KeyError:
                pass
        self.resolver.forget(pid)

    def describe(self) -> list[str]:
        """One line per process: its interpreter and how its layout was checked."""
        out = []
        for pid, lay in sorted(list(self.layouts.items())):
            out.append(f"pid {pid}: Python {lay.version[0]}.{lay.version[1]} in {lay.path} "
                       f"({lay.source}; {'; '.join(lay.checks)})")
        for pid, why in sorted(list(self.why_not.items())):
            out.append(f"pid {pid}: no Python frames: {why}")
        return out

    # ---- records -------------------------------------------------------------------------

    def on_def(self, buf: bytes) -> None:
        """A STACKDEF record: resolved on the resolver's thread. One the resolver has no
        room for is dropped, counted, and unmarked in the kernel, which sends it again
        at the stack's next sample."""
        try:
            d = schema.decode(buf)
        except Exception:  # schema.WireError, or a decoder's error on a short record
            self.resolver.undecodable += 1
            return
        if not self.resolver.put(d):
            self._unmark(d.pid, d.stack_id)

    def _unmark(self, pid: int, stack_id: int) -> None:
        table = self.bpf[b"stk_known"]
        key = table.Key()
        key.pid, key.stack_id = pid, stack_id
        try:
            del table[key]
        except KeyError:
            pass

    def take(self) -> list[StackFrames]:
        """Apply what the resolver found about processes; the stacks it named since."""
        for found in self.resolver.found():
            self._apply(found)
        return self.resolver.take()

    def drain(self) -> list[bytes]:
        """The stack counts still held per thread in the kernel, as KSTACKS records
        (sent before the open bursts are drained: they belong to them)."""
        table = self.bpf[b"stk_threads"]
        out = []
        for k, v in list(table.items()):
            if v.n:
                out.append(bytes(ctypes.string_at(ctypes.addressof(v), ctypes.sizeof(v))))
            try:
                del table[k]
            except KeyError:
                pass
        return out

    def finish(self, timeout: float = 10.0) -> list[StackFrames]:
        """Wait (at most ``timeout``) for the stacks queued so far, and take them."""
        self.resolver.wait_idle(timeout)
        return self.resolver.take()

    def counters(self) -> dict[str, int]:
        table = self.bpf[b"stk_counters"]
        out = {name: int(sum(table[ctypes.c_int(i)])) for i, name in enumerate(COUNTER_NAMES)}
        out.update(self.resolver.counters())
        out["stack_python_processes"] = len(self.layouts)
        return out


THREADS_ONLY = "threads"  # a Found that only maps a known process's threads again


@dataclass
class Found:
    """What a scan found about a process's interpreter (``layout``), or why not, and
    its threads' thread states (tid -> address, ``pystacks.thread_map``)."""

    pid: int
    generation: int
    layout: PyLayout | None
    why: str = ""
    threads: dict[int, int] = field(default_factory=dict)


def scan_interpreter(pid: int) -> PyLayout | str:
    """``pid``'s interpreter layout, or why there is none. Never raises: the files and
    memory of a traced process are not trusted (a damaged ELF file makes pyelftools
    raise what it likes), and a process that cannot be read gets native frames only."""
    try:
        return find_interpreter(pid)
    except (PyLayoutError, OSError) as e:
        return str(e)
    except Exception as e:  # a parser's error on what the process maps
        return f"cannot read its interpreter: {type(e).__name__}: {e}"


class StackResolver:
    """StackDef -> StackFrames, and interpreters found, on a thread of its own (the
    first use of a library reads its symbol table and unwind tables: up to seconds for
    libtorch_cuda.so)."""

    def __init__(self) -> None:
        self._layouts: dict[int, PyLayout] = {}
        self._readers: dict[int, CodeReader] = {}
        self._regions: dict[int, list[Region]] = {}
        self._load_cache: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
        self._seen: set[tuple[int, int]] = set()
        self.unwinder = Unwinder()
        self.symbols = Symbolizer(max_files=64)
        self._work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._out: list[StackFrames] = []
        self._found: list[Found] = []
        self._lock = threading.Lock()
        self._busy = 0
        self._idle = threading.Condition()
        self.unresolved = 0
        self.undecodable = 0
        self.dropped = 0
        self.max_defs = MAX_QUEUED_DEFS
        self._queued_defs = 0
        self._rejected_closed = 0  # frames rejected by readers since closed
        self._evicted_closed = 0
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="tt-stacks", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> None:
        with self._idle:
            self._busy += 1
        self._work.put(item)

    def put(self, d: StackDef) -> bool:
        """Queue a stack to resolve; False (dropped, counted) when ``max_defs`` are
        already waiting: a process making new stacks faster than they are resolved
        does not grow the agent's memory."""
        with self._idle:
            if self._queued_defs >= self.max_defs:
                self.dropped += 1
                return False
            self._queued_defs += 1
            self._busy += 1
        self._work.put(("def", d))
        return True

    def counters(self) -> dict[str, int]:
        """What resolving could not do (the exit report's stack_* counters)."""
        readers = list(self._readers.values())
        return {"stack_unresolved": self.unresolved, "stack_defs_dropped": self.dropped,
                "stack_defs_undecodable": self.undecodable,
                "stack_frames_rejected": self._rejected_closed + sum(r.rejected for r in readers),
                "stack_code_objects_evicted": self._evicted_closed
                + sum(r.evicted for r in readers)}

    def scan(self, pid: int, generation: int) -> None:
        """Find ``pid``'s interpreter (``found`` hands the result back)."""
        self._put(("scan", pid, generation))

    def threads(self, pid: int, generation: int) -> None:
        """Map ``pid``'s threads to their thread states again (``found``)."""
        self._put(("threads", pid, generation))

    def forget(self, pid: int) -> None:
        self._put(("forget", pid))

    def take(self) -> list[StackFrames]:
        with self._lock:
            out, self._out = self._out, []
        return out

    def found(self) -> list[Found]:
        with self._lock:
            out, self._found = self._found, []
        return out

    def wait_idle(self, timeout: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def _run(self) -> None:
        while True:
            item = self._work.get()
            try:
                if item[0] == "def":
                    with self._idle:
                        self._queued_defs -= 1
                    t0 = time.perf_counter()
                    try:
                        got = self.resolve(item[1])
                    except Exception as e:  # named as unresolved: records wait for no more
                        self.unresolved += 1
                        got = unresolved_frames(item[1], e)
                    self.seconds += time.perf_counter() - t0
                    if got is not None:
                        with self._lock:
                            self._out.append(got)
                elif item[0] == "scan":
                    pid, generation = item[1], item[2]
                    got = scan_interpreter(pid)
                    if isinstance(got, str):
                        found = Found(pid, generation, None, got)
                    else:
                        self._layouts[pid] = got
                        found = Found(pid, generation, got, threads=self._thread_map(pid))
                    with self._lock:
                        self._found.append(found)
                elif item[0] == "threads":
                    pid = item[1]
                    if pid in self._layouts:
                        found = Found(pid, item[2], None, THREADS_ONLY, self._thread_map(pid))
                        with self._lock:
                            self._found.append(found)
                elif item[0] == "forget":
                    pid = item[1]
                    self._layouts.pop(pid, None)
                    self._regions.pop(pid, None)
                    r = self._readers.pop(pid, None)
                    if r is not None:
                        self._rejected_closed += r.rejected
                        self._evicted_closed += r.evicted
                        r.close()
                    self._seen = {k for k in self._seen if k[0] != pid}
            except Exception:  # never let one stack stop the thread
                self.unresolved += 1
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()

    def _reader(self, pid: int, lay: PyLayout) -> CodeReader:
        reader = self._readers.get(pid)
        if reader is None:
            reader = self._readers[pid] = CodeReader(pid, lay)
        return reader

    def _thread_map(self, pid: int) -> dict[int, int]:
        """``pid``'s thread ids -> thread states (never raises: a process that cannot be
        read has its threads found by the kernel's own walk)."""
        lay = self._layouts[pid]
        try:
            return thread_map(self._reader(pid, lay).mem, lay, pid)
        except Exception:
            return {}

    # ---- resolution ------------------------------------------------------------------

    def resolve(self, d: StackDef) -> StackFrames | None:
        """Name one stack (once per process and id)."""
        key = (d.pid, d.stack_id)
        if key in self._seen:
            return None
        self._seen.add(key)
        lay = self._layouts.get(d.pid)
        python: list[str] = []
        if lay is not None and d.python:
            reader = self._reader(d.pid, lay)
            for code, instr in d.python:
                if not code:
                    continue
                fr = reader.frame(code, instr)
                if fr is None:
                    python.append("?\t?\t")
                else:
                    name, fname, line = fr
                    python.append(f"{name}\t{fname}\t{line if line is not None else ''}")
            python.reverse()
        stop_at = {lay.path} if lay is not None else set()
        native, why = self._native(d, stop_at)
        return StackFrames(pid=d.pid, stack_id=d.stack_id, what=d.what, handle=d.handle,
                           python=tuple(python), native=tuple(native), flags=d.flags,
                           native_stop=why)

    def _regions_of(self, pid: int, fresh: bool = False) -> list[Region]:
        """The executable file mappings of ``pid`` with their load bias (program headers
        only: symbols are read for the libraries that show up in stacks)."""
        got = self._regions.get(pid)
        if got is not None and not fresh:
            return got
        out = []
        for m in procfs.mappings(pid):
            if "x" not in m.perms:
                continue
            path = procfs.open_mapped(pid, m)
            loads = self._loads(path)
            for off, size, va in loads:
                if off <= m.offset < off + max(size, 1):
                    out.append(Region(m.start, m.end, m.start - (va + (m.offset - off)),
                                      m.path, path, m.inode))
                    break
        out.sort(key=lambda r: r.start)
        self._regions[pid] = out
        return out

    def _loads(self, path: str) -> list[tuple[int, int, int]]:
        """A file's PT_LOAD segments (offset, file size, vaddr), cached by inode."""
        try:
            st = os.stat(path)
        except OSError:
            return []
        key = (st.st_dev, st.st_ino, st.st_mtime_ns)
        got = self._load_cache.get(key)
        if got is None:
            try:
                with open(path, "rb") as f:
                    got = [(s["p_offset"], s["p_filesz"], s["p_vaddr"])
                           for s in ELFFile(f).iter_segments() if s["p_type"] == "PT_LOAD"]
            except (OSError, ELFError, ValueError):
                got = []
            self._load_cache[key] = got
        return got

    def _native(self, d: StackDef, stop_at: set[str]) -> tuple[list[str], str]:
        regions = self._regions_of(d.pid)
        if not any(r.start <= d.ip < r.end for r in regions):
            regions = self._regions_of(d.pid, fresh=True)  # a library loaded since
        got = self.unwinder.unwind(regions, d.ip, d.sp, d.bp, d.slice, stop_at)
        starts = [r.start for r in regions]
        names = []
        for pc in reversed(got.pcs):  # root first
            k = bisect_right(starts, pc) - 1
            reg = regions[k] if k >= 0 and pc < regions[k].end else None
            if reg is None:
                names.append(f"\t[{pc:#x}]")
                continue
            lib = reg.path.rsplit("/", 1)[-1]
            usable = reg.usable_path()
            sym = function_containing(self.symbols, usable, pc - reg.bias) if usable else None
            names.append(f"{native_name(sym)}\t{lib}" if sym
                         else f"\t{lib}+{pc - reg.bias:#x}")
        return names, got.stop


def unresolved_frames(d: StackDef, error: Exception) -> StackFrames:
    """What a stack that could not be resolved is named: one frame that says so (the
    records using it need not wait for a name that will not come)."""
    return StackFrames(pid=d.pid, stack_id=d.stack_id, what=d.what, handle=d.handle,
                       python=(), native=(f"[unresolved: {type(error).__name__}]\t",),
                       flags=d.flags, native_stop=f"error: {type(error).__name__}")


def function_containing(symbols: Symbolizer, path: str, vaddr: int) -> str | None:
    """The function symbol whose [start, start + size) holds ``vaddr``, or None."""
    try:
        elf: ElfFunctions = symbols.functions(path)
    except SymbolError:
        return None
    return elf.containing(vaddr, path)


