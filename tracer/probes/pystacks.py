"""Where a CPython process keeps its threads and frames, for the stack sampler.

For each traced process, ``find_interpreter`` looks for the interpreter in its mappings
(``libpythonX.Y.so``, or a static ``python`` executable exporting ``_PyRuntime``) and
returns a ``PyLayout``: the address of ``_PyRuntime`` and the offsets bpf/stacks.c
needs to go from there to the current thread's frames (``_PyRuntime`` -> interpreters
-> thread states, matched by native thread id -> frame chain -> code objects), plus
what user space needs to name a code object (``pycode.py``).

Where the offsets come from:

- 3.13 and later publish them: ``_PyRuntime`` starts with ``_Py_DebugOffsets`` (cookie
  ``xdebugpy``, the version, then per structure its size and field offsets), read from
  the process's memory. Its layout itself changed between releases (3.13 added a
  ``free_threaded`` word; later versions added fields in the middle), so the known
  variants are tried and the one whose sizes and offsets make sense is taken.
- 3.10, 3.11 and 3.12: tables made from CPython's headers (``Include/cpython/
  pystate.h``, ``Include/internal/pycore_{runtime,interp,frame}.h``, ``frameobject.h``)
  for x86-64. 3.11's were checked by compiling ``offsetof`` against the installed
  headers.

Neither is trusted blindly. Offsets are cross-checked against the interpreter's own
code, where the exported accessors are one load (``PyInterpreterState_Head`` reads
``_PyRuntime.interpreters.head``, ``PyInterpreterState_ThreadHead`` reads
``threads.head``, ``PyThreadState_Next`` and ``PyInterpreterState_Next`` read ``next``),
and against the live process: its thread list must hold its own thread ids, and its
frames must point at objects whose type is ``PyCode_Type``. Code object field offsets
are read from ``PyCode_Type``'s own member table (``tp_members``: ``co_filename``,
``co_name``, ...), and where its code units start from its ``tp_basicsize`` (3.11+).
A process that fails a check gets no Python frames, and the reason is kept.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from tracer.probes import procfs

_LIBPYTHON = re.compile(r"/libpython3\.(\d+)[a-z]*\.so(\.[\d.]+)?$")
_PYTHON_EXE = re.compile(r"/python3\.?(\d+)?[a-z]*$")
_SYM64 = struct.Struct("<IBBHQQ")
WANTED = ("_PyRuntime", "PyCode_Type", "Py_Version", "PyInterpreterState_Head",
          "PyInterpreterState_ThreadHead", "PyThreadState_Next", "PyInterpreterState_Next",
          "PyUnicode_Type", "PyBytes_Type")
TP_BASICSIZE = 32  # offsetof(PyTypeObject, tp_basicsize): stable public layout
TP_MEMBERS = 240  # offsetof(PyTypeObject, tp_members)
MEMBER_DEF = struct.Struct("<QiiqiiQ")  # PyMemberDef: name, type, (pad), offset, flags, (pad), doc
OB_TYPE = 8


class PyLayoutError(Exception):
    """The process's interpreter cannot be walked; the message says why."""


@dataclass
class PyLayout:
    """Everything the sampler needs about one process's interpreter."""

    version: tuple[int, int]
    path: str  # the file holding the interpreter, as mapped
    runtime: int  # &_PyRuntime in the process
    code_type: int  # &PyCode_Type in the process
    source: str  # "headers" or "_Py_DebugOffsets"
    # bpf/stacks.c's struct py_layout
    interp_head: int
    interp_next: int
    threads_head: int
    ts_next: int
    ts_tid: int
    ts_frame: int
    cframe_frame: int
    fr_prev: int
    fr_code: int
    fr_instr: int
    fr_owner: int
    fr_size: int
    tid_is_pthread: int = 0
    instr_is_int: int = 0
    cstack_owner: int = 0xFF
    stack_max: int = 8 << 20  # 3.10: a thread's stack size (default_stack_size)
    # user space: code objects and strings
    code_fields: dict[str, int] = field(default_factory=dict)  # co_* -> offset
    code_units: int = 0  # offsetof(PyCodeObject, co_code_adaptive) (3.11+)
    str_type: int = 0  # &PyUnicode_Type, &PyBytes_Type in the process (0: not known)
    bytes_type: int = 0
    ascii_size: int = 48  # sizeof(PyASCIIObject)
    compact_size: int = 72  # sizeof(PyCompactUnicodeObject)
    checks: list[str] = field(default_factory=list)  # what was verified, in words

    def bpf_fields(self) -> dict[str, int]:
        """The values of bpf/stacks.c's struct py_layout, by field name."""
        names = ("runtime", "interp_head", "interp_next", "threads_head", "ts_next", "ts_tid",
                 "ts_frame", "cframe_frame", "fr_prev", "fr_code", "fr_instr", "fr_owner",
                 "fr_size", "tid_is_pthread", "instr_is_int", "cstack_owner", "stack_max")
        return {n: getattr(self, n) for n in names}


# x86-64 offsets from CPython's headers (see the module docstring): thread and frame
# structures; code objects are read from PyCode_Type at run time.
_HEADERS: dict[tuple[int, int], dict[str, int]] = {
    # _PyRuntimeState.interpreters.head after 4 ints and _finalizing; PyInterpreterState
    # {next, tstate_head}; PyThreadState {prev, next, interp, frame, ...}, thread_id
    # after the 3-pointer _PyErr_StackItem + exc_info, dict, gilstate_counter, async_exc;
    # PyFrameObject {VAR_HEAD, f_back, f_code, ..., f_stackdepth, 3 chars + PyFrameState
    # (a signed char), f_lasti}
    (3, 10): dict(interp_head=32, interp_next=0, threads_head=8, ts_next=8, ts_tid=176,
                  ts_frame=24, cframe_frame=-1, fr_prev=24, fr_code=32, fr_instr=88,
                  fr_owner=-1, fr_size=96, tid_is_pthread=1, instr_is_int=1,
                  cstack_owner=0xFF),
    # checked with offsetof against Python 3.11.7's own headers
    (3, 11): dict(interp_head=40, interp_next=0, threads_head=16, ts_next=8, ts_tid=160,
                  ts_frame=56, cframe_frame=8, fr_prev=48, fr_code=32, fr_instr=56,
                  fr_owner=69, fr_size=72, cstack_owner=0xFF),
    # _is {next, id, id_refcount, requires_idref, id_mutex, _initialized, finalizing,
    # monitoring_version, last_restart_version, threads {next_unique_id, head}};
    # _ts {prev, next, interp, _status, 6 ints, cframe, ...}; _PyCFrame {current_frame,
    # previous}; _PyInterpreterFrame {f_code, previous, f_funcobj, f_globals, f_builtins,
    # f_locals, frame_obj, prev_instr, stacktop, return_offset, owner}
    (3, 12): dict(interp_head=40, interp_next=0, threads_head=72, ts_next=8, ts_tid=144,
                  ts_frame=56, cframe_frame=0, fr_prev=8, fr_code=0, fr_instr=56,
                  fr_owner=70, fr_size=72, cstack_owner=3),
}
# sizeof(PyASCIIObject), sizeof(PyCompactUnicodeObject): wstr went in 3.12
_UNICODE = {(3, 10): (48, 72), (3, 11): (48, 72)}


@dataclass
class _ElfInfo:
    symbols: dict[str, tuple[int, int]]  # name -> (vaddr, size)
    loads: list[tuple[int, int, int, int]]  # (p_offset, p_filesz, p_vaddr, p_memsz)


_ELF_CACHE: dict[tuple[int, int, int], _ElfInfo] = {}


def _elf_info(path: str) -> _ElfInfo:
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_mtime_ns)
    got = _ELF_CACHE.get(key)
    if got is not None:
        return got
    syms: dict[str, tuple[int, int]] = {}
    wanted = {w.encode() for w in WANTED}
    with open(path, "rb") as f:
        elf = ELFFile(f)
        loads = [(s["p_offset"], s["p_filesz"], s["p_vaddr"], s["p_memsz"])
                 for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
        for name in (".dynsym", ".symtab"):
            sec = elf.get_section_by_name(name)
            if sec is None or sec["sh_type"] == "SHT_NOBITS" or sec["sh_entsize"] != _SYM64.size:
                continue
            strtab = elf.get_section(sec["sh_link"])
            f.seek(strtab["sh_offset"])
            strings = f.read(strtab["sh_size"])
            f.seek(sec["sh_offset"])
            data = f.read(sec["sh_size"] - sec["sh_size"] % _SYM64.size)
            for st_name, _info, _other, shndx, value, size in _SYM64.iter_unpack(data):
                if not shndx or not value:
                    continue
                end = strings.find(b"\0", st_name)
                nm = strings[st_name:end]
                if nm in wanted:
                    syms.setdefault(nm.decode(), (value, size))
    info = _ElfInfo(syms, loads)
    _ELF_CACHE[key] = info
    return info


def _file_offset(info: _ElfInfo, vaddr: int) -> int | None:
    for off, filesz, va, _memsz in info.loads:
        if va <= vaddr < va + filesz:
            return vaddr - va + off
    return None


def _bias(info: _ElfInfo, maps: list[procfs.Mapping], path: str) -> int | None:
    """Process address minus ELF virtual address for the file mapped at ``path``."""
    for m in maps:
        if m.path != path:
            continue
        for off, filesz, va, _memsz in info.loads:
            if off <= m.offset < off + max(filesz, 1):
                return m.start - (va + (m.offset - off))
    return None


def _interpreter_file(pid: int, maps: list[procfs.Mapping]) -> tuple[str, str, int | None]:
    """(path as mapped, path to open, minor version from the name or None)."""
    for m in maps:
        mt = _LIBPYTHON.search(m.path)
        if mt:
            return m.path, procfs.open_mapped(pid, m), int(mt.group(1))
    exe = procfs.exe(pid)
    for m in maps:
        if m.path == exe:
            mt = _PYTHON_EXE.search(exe)
            minor = int(mt.group(1)) if mt and mt.group(1) else None
            return m.path, procfs.open_mapped(pid, m), minor
    raise PyLayoutError("no libpython and no executable mapping")


class _Memory:
    """Reads of the traced process's memory (/proc/PID/mem); ``refresh_s``: see
    ``ProcessMemory`` (a long-lived reader sees memory mapped after it was made)."""

    def __init__(self, pid: int, refresh_s: float | None = None) -> None:
        from tracer.probes.prenames import ProcessMemory

        self.mem = ProcessMemory(pid, refresh_s)

    def read(self, addr: int, n: int) -> bytes:
        return self.mem.read(addr, n) if addr > 0 else b""

    def u64(self, addr: int) -> int:
        b = self.read(addr, 8)
        return int.from_bytes(b, "little") if len(b) == 8 else 0

    def close(self) -> None:
        self.mem.close()


def _disp_load(code: bytes) -> tuple[str, int] | None:
    """The one load an accessor makes: ("rip", address - function start) for ``mov
    disp32(%rip),%rax``; ("got", offset) for the same through the GOT (``mov
    got(%rip),%rax; mov off(%rax),%rax``, a shared libpython); ("rdi", offset) for
    ``mov off(%rdi),%rax``; None for anything else. A leading ENDBR64 is skipped."""
    i = 4 if code[:4] == b"\xf3\x0f\x1e\xfa" else 0
    c = code[i:]
    if len(c) >= 7 and c[:3] == b"\x48\x8b\x05":
        nxt = c[7:]
        if nxt[:3] == b"\x48\x8b\x40" and len(nxt) >= 4:
            return "got", struct.unpack_from("<b", nxt, 3)[0]
        if nxt[:3] == b"\x48\x8b\x80" and len(nxt) >= 7:
            return "got", struct.unpack_from("<i", nxt, 3)[0]
        return "rip", i + 7 + struct.unpack_from("<i", c, 3)[0]
    if len(c) >= 4 and c[:3] == b"\x48\x8b\x47":
        return "rdi", struct.unpack_from("<b", c, 3)[0]
    if len(c) >= 7 and c[:3] == b"\x48\x8b\x87":
        return "rdi", struct.unpack_from("<i", c, 3)[0]
    return None


def _accessor_offsets(path: str, info: _ElfInfo) -> dict[str, int]:
    """Offsets read from the interpreter's own accessor functions (where each is one
    plain load): interp_head, threads_head, ts_next, interp_next."""
    out: dict[str, int] = {}
    runtime = info.symbols.get("_PyRuntime")
    with open(path, "rb") as f:
        for sym, key in (("PyInterpreterState_Head", "interp_head"),
                         ("PyInterpreterState_ThreadHead", "threads_head"),
                         ("PyThreadState_Next", "ts_next"),
                         ("PyInterpreterState_Next", "interp_next")):
            s = info.symbols.get(sym)
            off = _file_offset(info, s[0]) if s else None
            if off is None:
                continue
            f.seek(off)
            load = _disp_load(f.read(16))
            if load is None:
                continue
            kind, disp = load
            if key == "interp_head":
                if kind == "rip" and runtime is not None:
                    out[key] = s[0] + disp - runtime[0]  # type: ignore[index]
                elif kind == "got":
                    out[key] = disp
            elif kind == "rdi":
                out[key] = disp
    return out


# _Py_DebugOffsets (3.13+): the words before each section's first field, per known
# variant: (free_threaded word present, fields of interpreter_state)
_DEBUG_VARIANTS = ((True, 13), (True, 14), (False, 11), (True, 11), (False, 13))


def _debug_offsets(mem: _Memory, runtime: int) -> dict[str, int] | None:
    """The offsets 3.13+ publishes in ``_PyRuntime.debug_offsets``, or None."""
    raw = mem.read(runtime, 8 * 80)
    if len(raw) < 8 * 60 or raw[:8] != b"xdebugpy":
        return None
    words = struct.unpack_from(f"<{len(raw) // 8}Q", raw)
    for free_threaded, n_interp in _DEBUG_VARIANTS:
        i = 2 + (1 if free_threaded else 0)
        rt = words[i:i + 3]  # size, finalizing, interpreters_head
        i += 3
        it = words[i:i + n_interp]  # size, id, next, threads_head, ...
        i += n_interp
        ts = words[i:i + 9]  # size, prev, next, interp, current_frame, thread_id, native_thread_id, ...
        i += 9
        fr = words[i:i + 6]  # size, previous, executable, instr_ptr, localsplus, owner
        i += 6
        co = words[i:i + 10]  # size, filename, name, qualname, linetable, firstlineno, ...
        i += 10
        ok = (1000 < rt[0] < 1 << 22 and 0 < rt[2] < rt[0]
              and 1000 < it[0] < 1 << 22 and it[2] < it[0] and 0 < it[3] < it[0]
              and 100 < ts[0] < 8192 and all(x < ts[0] for x in ts[1:7])
              and 32 <= fr[0] <= 256 and all(x <= fr[0] for x in fr[1:6])
              and 64 <= co[0] <= 1024 and all(16 <= x < co[0] for x in co[1:6]))
        if not ok:
            continue
        d = dict(interp_head=rt[2], interp_next=it[2], threads_head=it[3], ts_next=ts[2],
                 ts_tid=ts[6], ts_frame=ts[4], cframe_frame=-1, fr_prev=fr[1], fr_code=fr[2],
                 fr_instr=fr[3], fr_owner=fr[5], cstack_owner=3)
        d["fr_size"] = min(128, (max(fr[1], fr[2], fr[3], fr[5]) + 8 + 7) // 8 * 8)
        d["code_units"] = co[9]
        d["version_hex"] = words[1]
        d["free_threaded"] = words[2] if free_threaded else 0
        return d
    return None


def _members(mem: _Memory, type_addr: int) -> dict[str, int]:
    """name -> offset from a type's ``tp_members`` (PyMemberDef array) in memory."""
    out: dict[str, int] = {}
    arr = mem.u64(type_addr + TP_MEMBERS)
    for i in range(64):
        raw = mem.read(arr + i * MEMBER_DEF.size, MEMBER_DEF.size)
        if len(raw) < MEMBER_DEF.size:
            break
        name_ptr, _typ, _pad, offset, _flags, _pad2, _doc = MEMBER_DEF.unpack(raw)
        if not name_ptr:
            break
        name = mem.read(name_ptr, 64).split(b"\0", 1)[0].decode("ascii", "replace")
        out[name] = offset
    return out


def find_interpreter(pid: int) -> PyLayout:
    """The interpreter layout of ``pid``; PyLayoutError says why there is none."""
    maps = procfs.mappings(pid)
    if not maps:
        raise PyLayoutError("process gone or no mappings")
    mapped, path, minor = _interpreter_file(pid, maps)
    try:
        info = _elf_info(path)
    except (OSError, ELFError, struct.error) as e:
        raise PyLayoutError(f"{mapped}: cannot read its symbols: {e}") from e
    if "_PyRuntime" not in info.symbols or "PyCode_Type" not in info.symbols:
        raise PyLayoutError(f"{mapped}: no _PyRuntime/PyCode_Type symbol (not CPython)")
    bias = _bias(info, maps, mapped)
    if bias is None:
        raise PyLayoutError(f"{mapped}: its load address is not in /proc/{pid}/maps")
    runtime = info.symbols["_PyRuntime"][0] + bias
    code_type = info.symbols["PyCode_Type"][0] + bias
    mem = _Memory(pid)
    try:
        version = None
        if "Py_Version" in info.symbols:
            hexv = mem.u64(info.symbols["Py_Version"][0] + bias) & 0xFFFFFFFF
            version = (hexv >> 24, (hexv >> 16) & 0xFF)
        elif minor is not None:
            version = (3, minor)
        if version is None:
            raise PyLayoutError(f"{mapped}: Python version unknown")
        layout = _layout(mem, version, mapped, runtime, code_type)
        for name, attr in (("PyUnicode_Type", "str_type"), ("PyBytes_Type", "bytes_type")):
            if name in info.symbols:
                setattr(layout, attr, info.symbols[name][0] + bias)
        layout.checks += _cross_check(path, info, layout)
        layout.checks += _check_live(pid, mem, layout)
        layout.stack_max = default_stack_size(pid)
    finally:
        mem.close()
    return layout


def _layout(mem: _Memory, version: tuple[int, int], mapped: str, runtime: int,
            code_type: int) -> PyLayout:
    if version > (3, 13):
        raise PyLayoutError(f"Python {version[0]}.{version[1]} is not supported (3.10-3.13:"
                            " 3.14 changed the frame layout)")
    debug = _debug_offsets(mem, runtime) if version >= (3, 13) else None
    if debug is not None:
        code_units = debug.pop("code_units")
        debug.pop("version_hex")
        if debug.pop("free_threaded"):
            raise PyLayoutError("a free-threaded build (its frames and thread states "
                                "differ from the GIL build's)")
        lay = PyLayout(version, mapped, runtime, code_type, "_Py_DebugOffsets", **debug)
        lay.code_units = code_units
    elif version in _HEADERS:
        lay = PyLayout(version, mapped, runtime, code_type, "headers", **_HEADERS[version])
    else:
        raise PyLayoutError(f"Python {version[0]}.{version[1]} is not supported (3.10-3.13)")
    members = _members(mem, code_type)
    need = ("co_filename", "co_name", "co_firstlineno", "co_linetable")
    missing = [m for m in need if m not in members]
    if missing:
        raise PyLayoutError(f"PyCode_Type has no member {missing[0]} (read {len(members)})")
    lay.code_fields = {k: v for k, v in members.items() if k.startswith("co_")}
    if version >= (3, 11):
        basic = mem.u64(code_type + TP_BASICSIZE)
        if lay.code_units and basic != lay.code_units:
            raise PyLayoutError(f"co_code_adaptive at {lay.code_units} but PyCode_Type's "
                                f"basic size is {basic}")
        lay.code_units = basic
    elif "co_code" not in members:
        raise PyLayoutError("3.10 PyCode_Type has no co_code member")
    lay.ascii_size, lay.compact_size = _UNICODE.get(version, (40, 56))
    lay.checks.append(f"code object fields from PyCode_Type.tp_members ({len(members)})")
    return lay


def _cross_check(path: str, info: _ElfInfo, lay: PyLayout) -> list[str]:
    got = _accessor_offsets(path, info)
    for key, value in got.items():
        if getattr(lay, key) != value:
            raise PyLayoutError(f"{key} is {getattr(lay, key)} by the {lay.source}, but the "
                                f"interpreter's accessor reads {value}")
    return [f"{', '.join(sorted(got))} agree with the interpreter's accessors"] if got else []


def _tids(pid: int) -> set[int]:
    try:
        return {int(t) for t in os.listdir(f"/proc/{pid}/task")}
    except OSError:
        return set()


GLIBC_STACK_DEFAULT = 2 << 20  # x86-64 glibc's thread stack size with no stack rlimit
THREADS_MAX = 4096  # thread states user space walks per process (the kernel: 128)


def default_stack_size(pid: int) -> int:
    """The stack size glibc gives ``pid``'s threads: its stack rlimit (soft), or
    glibc's default where that is unlimited. 3.10's thread matching: a thread's own
    descriptor lies within this above its stack pointer, another thread's farther."""
    try:
        with open(f"/proc/{pid}/limits") as f:
            for line in f:
                if line.startswith("Max stack size"):
                    soft = line.split()[3]
                    return GLIBC_STACK_DEFAULT if soft == "unlimited" else int(soft)
    except (OSError, ValueError, IndexError):
        pass
    return 8 << 20


def thread_map(mem: _Memory, lay: PyLayout, pid: int, limit: int = THREADS_MAX
               ) -> dict[int, int]:
    """Thread id -> thread state, for the kernel's ``stk_tstate`` (it walks only the
    newest 128 states itself; a server's main or engine thread is the oldest, behind
    its pools' threads). 3.10 keeps no thread id: only the main thread's (the oldest
    state of the main interpreter), keyed by the pid."""
    if lay.tid_is_pthread:
        interp, last = mem.u64(lay.runtime + lay.interp_head), 0
        for _ in range(4):  # the main interpreter is the last of the list
            if not interp:
                break
            last = interp
            interp = mem.u64(interp + lay.interp_next)
        ts, oldest = (mem.u64(last + lay.threads_head) if last else 0), 0
        for _ in range(limit):
            if not ts:
                break
            oldest = ts
            ts = mem.u64(ts + lay.ts_next)
        return {pid: oldest} if oldest else {}
    out: dict[int, int] = {}
    for ts in thread_states(mem, lay, limit):
        tid = mem.u64(ts + lay.ts_tid)
        if 0 < tid < 1 << 32:
            out.setdefault(tid, ts)
    return out


def thread_states(mem: _Memory, lay: PyLayout, limit: int = 256) -> list[int]:
    """The thread states of every interpreter of the process, newest first."""
    out: list[int] = []
    interp = mem.u64(lay.runtime + lay.interp_head)
    for _ in range(4):
        if not interp:
            break
        ts = mem.u64(interp + lay.threads_head)
        while ts and len(out) < limit:
            out.append(ts)
            ts = mem.u64(ts + lay.ts_next)
        interp = mem.u64(interp + lay.interp_next)
    return out


def frame_codes(mem: _Memory, lay: PyLayout, ts: int, limit: int = 8) -> list[int]:
    """The code objects of a thread's innermost ``limit`` frames (shims left out)."""
    fr = mem.u64(ts + lay.ts_frame)
    if lay.cframe_frame >= 0 and fr:
        fr = mem.u64(fr + lay.cframe_frame)
    out = []
    for _ in range(limit):
        if not fr:
            break
        raw = mem.read(fr, lay.fr_size)
        if len(raw) < lay.fr_size:
            break
        code = int.from_bytes(raw[lay.fr_code:lay.fr_code + 8], "little") & ~3
        shim = lay.fr_owner >= 0 and raw[lay.fr_owner] == lay.cstack_owner
        if code and not shim:
            out.append(code)
        fr = int.from_bytes(raw[lay.fr_prev:lay.fr_prev + 8], "little")
    return out


def _check_live(pid: int, mem: _Memory, lay: PyLayout) -> list[str]:
    """The layout must find the process's threads and code objects."""
    states = thread_states(mem, lay)
    if not states:
        raise PyLayoutError("the interpreter has no thread state (not initialised yet?)")
    if not lay.tid_is_pthread:
        tids = _tids(pid)
        ids = [mem.u64(ts + lay.ts_tid) for ts in states]
        ours = sum(1 for i in ids if i in tids)
        if not ours:
            raise PyLayoutError(f"none of {len(states)} thread states holds a thread id of "
                                f"the process (read {ids[:4]})")
        said = f"{ours} of {len(states)} thread states name its threads"
    else:
        said = f"{len(states)} thread states"
    codes = [c for ts in states for c in frame_codes(mem, lay, ts)]
    bad = [c for c in codes if mem.u64(c + OB_TYPE) != lay.code_type]
    if bad:
        raise PyLayoutError(f"{len(bad)} of {len(codes)} frames do not point at code objects")
    return [said, f"{len(codes)} frames point at code objects"]
