"""Name a Python frame of another process: a code object pointer and an instruction
pointer (as bpf/stacks.c records them) to (qualified name, file, line).

The code object's fields are read from ``/proc/PID/mem`` at the offsets its type
publishes (``pystacks.PyLayout.code_fields``); strings are read as CPython lays out a
``str`` (compact ASCII, compact 1/2/4-byte kinds, or a separate buffer) and bytes as a
``bytes`` object. Lines come from the line table (``pylines``). Each code object is
read once per process and kept, the least recently used let go past 100,000 code
objects or MAX_CACHED_BYTES (counted: read again when needed): code objects of a
server's modules live as long as it does (a code object freed and its memory reused by
another would keep the first name; a process's cache is dropped when it exits). A code object that cannot be read is
tried again after ``RETRY_S`` (it may lie in memory mapped since the process's mappings
were read, which are then read again: lazily imported model code).

What is read goes into spans and captures, so nothing but a name or a path may come out
of it: the resolver reads a code object some time after the sample, and one freed in
between may point at memory now holding another live string (a request's text). So a
code object must have a plausible reference count and still hold the same pointers
after its strings were read, each string must be a ``str`` (``PyUnicode_Type``) with a
plausible reference count, and names and paths must be short and made of the
characters names and paths are made of (``safe_name``, ``safe_path``); what fails is
``?`` and counted (``rejected``).
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from dataclasses import dataclass

from tracer.probes.pylines import line_310, line_311
from tracer.probes.pystacks import OB_TYPE, PyLayout, _Memory

MAX_STR = 256  # longer names and paths are not taken (V1: nothing long comes out)
MAX_TABLE = 1 << 20
MAX_REFCNT = 1 << 40  # a live object's count (immortal ones: 2^32 - 1); a freed one's
#                       first word is the allocator's free-list pointer, or 0
_NAME = re.compile(r"[\w.<>]+")  # qualified names: identifiers, dots, <locals>, <lambda>
_PATH = re.compile(r"(<[\w.\- ]+>)?[\w./\-+@~:,=<>]*")  # paths, <frozen x>, <string>
MAX_CACHED_BYTES = 32 << 20  # per process: code objects kept (line tables mostly), LRU
MAPS_REFRESH_S = 1.0  # an address outside the known mappings: maps read again, at most this often
RETRY_S = 1.0  # a code object that could not be read is tried again after this


@dataclass(frozen=True)
class CodeInfo:
    """What a frame needs of its code object."""

    name: str  # the qualified name (3.11+), else the name
    filename: str
    firstlineno: int
    linetable: bytes


class CodeReader:
    """Code objects of one process, read on demand and kept (LRU)."""

    def __init__(self, pid: int, layout: PyLayout, max_codes: int = 100_000,
                 max_bytes: int = MAX_CACHED_BYTES) -> None:
        self.pid = pid
        self.layout = layout
        self.mem = _Memory(pid, refresh_s=MAPS_REFRESH_S)
        self.max_codes = max_codes
        self.max_bytes = max_bytes
        self.bytes = 0  # what the kept code objects hold (their line tables and strings)
        self.evicted = 0  # code objects let go to stay under max_codes and max_bytes
        self._codes: OrderedDict[int, CodeInfo] = OrderedDict()
        self._failed: OrderedDict[int, float] = OrderedDict()  # addr -> when it failed
        self.reads = 0
        self.failed = 0
        self.rejected = 0  # code objects whose name or path was not taken (see above)

    def close(self) -> None:
        self.mem.close()

    def code(self, addr: int) -> CodeInfo | None:
        """The code object at ``addr`` (None: not a code object, or unreadable)."""
        got = self._codes.get(addr)
        if got is not None:
            self._codes.move_to_end(addr)
            return got
        now = time.monotonic()
        when = self._failed.get(addr)
        if when is not None and now - when < RETRY_S:
            return None
        info = self._read_code(addr)
        self.reads += 1
        if info is None:
            self.failed += 1
            self._failed[addr] = now
            self._failed.move_to_end(addr)
            while len(self._failed) > self.max_codes:
                self._failed.popitem(last=False)
            return None
        self._failed.pop(addr, None)
        self._codes[addr] = info
        self.bytes += _size(info)
        while len(self._codes) > 1 and (len(self._codes) > self.max_codes
                                        or self.bytes > self.max_bytes):
            self.bytes -= _size(self._codes.popitem(last=False)[1])
            self.evicted += 1
        return info

    def frame(self, code: int, instr: int) -> tuple[str, str, int | None] | None:
        """(name, file, line) of a frame, or None if its code object cannot be read."""
        info = self.code(code)
        if info is None:
            return None
        lay = self.layout
        if lay.version >= (3, 11):
            unit = (instr - (code + lay.code_units)) // 2 if instr else -1
            if unit > len(info.linetable) * 8 + 4096:  # not inside this code object
                unit = -1
            line = line_311(info.linetable, info.firstlineno, unit)
        else:
            lasti = instr - (1 << 64) if instr >= 1 << 63 else instr
            line = line_310(info.linetable, info.firstlineno, lasti * 2)
        return info.name, info.filename, line

    # ---- object reading ------------------------------------------------------------

    def _head(self, addr: int, n: int, type_addr: int) -> bytes | None:
        """``n`` bytes of the object at ``addr`` if it is a live object of the type at
        ``type_addr`` (0: any type), else None."""
        raw = self.mem.read(addr, n) if addr else b""
        if len(raw) < max(n, 16):
            return None
        refcnt = int.from_bytes(raw[:8], "little")
        if not 0 < refcnt < MAX_REFCNT:
            return None
        if type_addr and int.from_bytes(raw[OB_TYPE:OB_TYPE + 8], "little") != type_addr:
            return None
        return raw

    def _read_code(self, addr: int) -> CodeInfo | None:
        lay = self.layout
        f = lay.code_fields
        end = max(max(f.values()) + 8, 16)
        raw = self._head(addr, end, lay.code_type)
        if raw is None or not lay.code_type:
            return None

        def ptr(name: str, raw: bytes = raw) -> int:
            off = f.get(name)
            return int.from_bytes(raw[off:off + 8], "little") if off is not None else 0

        used = ("co_qualname", "co_name", "co_filename", "co_linetable")

        name = self._str(ptr("co_qualname")) if "co_qualname" in f else None
        name = name or self._str(ptr("co_name"))
        filename = self._str(ptr("co_filename"))
        off = f["co_firstlineno"]
        firstlineno = int.from_bytes(raw[off:off + 4], "little", signed=True)
        table = self._bytes(ptr("co_linetable"))
        # still the same live code object: it was not freed while its strings were read
        again = self._head(addr, end, lay.code_type)
        if again is None or any(ptr(k, again) != ptr(k) for k in used) or (
                again[off:off + 4] != raw[off:off + 4]):
            return None
        if name is not None and not safe_name(name):
            name = None
        if filename is not None and not safe_path(filename):
            filename = None
        if name is None or filename is None:
            self.rejected += 1
        return CodeInfo(name or "?", filename or "?", firstlineno, table)

    def _bytes(self, addr: int) -> bytes:
        head = self._head(addr, 32, self.layout.bytes_type)
        if head is None:
            return b""
        n = int.from_bytes(head[16:24], "little")
        if not 0 <= n <= MAX_TABLE:
            return b""
        return self.mem.read(addr + 32, n)

    def _str(self, addr: int) -> str | None:
        lay = self.layout
        head = self._head(addr, lay.compact_size + 8, lay.str_type)
        if head is None:
            return None
        length = int.from_bytes(head[16:24], "little")
        state = int.from_bytes(head[32:36], "little")
        kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
        if kind not in (1, 2, 4) or not 0 < length <= MAX_STR:
            return None
        if compact and ascii_:
            data = self.mem.read(addr + lay.ascii_size, length)
        elif compact:
            data = self.mem.read(addr + lay.compact_size, length * kind)
        else:
            buf = int.from_bytes(head[lay.compact_size:lay.compact_size + 8], "little")
            data = self.mem.read(buf, length * kind)
        codec = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind]
        return data.decode(codec, "replace")


def _size(info: CodeInfo) -> int:
    """Roughly what keeping ``info`` costs, in bytes."""
    return 200 + len(info.linetable) + len(info.name) + len(info.filename)


def safe_name(text: str) -> bool:
    """Whether ``text`` can be a code object's (qualified) name: at most MAX_STR
    characters of identifiers, dots and ``<...>`` (``<locals>``, ``<lambda>``)."""
    return 0 < len(text) <= MAX_STR and _NAME.fullmatch(text) is not None


def safe_path(text: str) -> bool:
    """Whether ``text`` can be a code object's file name: at most MAX_STR characters of
    a path (no spaces, but in a leading ``<frozen module>``)."""
    return 0 < len(text) <= MAX_STR and _PATH.fullmatch(text) is not None
