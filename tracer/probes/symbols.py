"""Name a code address of a live process: the ELF function symbol that starts there.

``/proc/PID/maps`` gives the mapping that holds the address and the file offset the
mapping starts at; the file's PT_LOAD program headers turn that file offset into the
ELF virtual address that symbols are stated in. That is exact for executables (PIE or
not) and shared objects alike, whatever the load bias, with no guess at it. The file is
opened through ``/proc/PID/root`` so a containerised process's own copy is read (and,
if that path is gone, through ``/proc/PID/map_files``).

A function pointer is the address of its function's first instruction, so only a
symbol that starts exactly there names it; ``.symtab`` is searched first, ``.dynsym``
where ``.symtab`` was stripped or lacks it. An address inside another function, with
no symbol, or with several unrelated names is an error that says so: never a guess.

Each file's function symbols are read once and kept (by device, inode, size and
mtime) as sorted address arrays; names are read from the string table on demand, so a
library with hundreds of thousands of symbols costs a few MB, not its string table.
"""

from __future__ import annotations

import os
import struct
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from dataclasses import dataclass

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from tracer.probes import procfs

_FUNC_TYPES = (2, 10)  # STT_FUNC, STT_GNU_IFUNC
_SYM64 = struct.Struct("<IBBHQQ")  # Elf64_Sym, little-endian: name, info, other, shndx, value, size
_TABLES = (".symtab", ".dynsym")


class SymbolError(Exception):
    """An address that cannot be named; the message says why."""


@dataclass(frozen=True)
class Symbol:
    """What an address resolved to."""

    name: str
    path: str  # the file, as the process maps it
    vaddr: int  # ELF virtual address (the symbol's st_value)
    table: str  # ".symtab" or ".dynsym"


@dataclass
class _Table:
    """Defined function symbols of one symbol table, sorted by address."""

    values: array  # st_value, ascending
    sizes: array
    name_offs: array  # st_name: offsets into strtab
    strtab: tuple[int, int]  # (file offset, size) of the string table


class ElfFunctions:
    """The PT_LOAD segments and function symbols of one ELF file."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            elf = ELFFile(f)
            self.loads = [(s["p_offset"], s["p_filesz"], s["p_vaddr"])
                          for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
            self.tables: dict[str, _Table] = {}
            for name in _TABLES:
                sec = elf.get_section_by_name(name)
                if sec is not None and sec["sh_type"] != "SHT_NOBITS":
                    self.tables[name] = _read_table(elf, f, sec)

    def vaddr_of(self, file_offset: int) -> int | None:
        """The ELF virtual address that ``file_offset`` is loaded at, or None."""
        for off, size, vaddr in self.loads:
            if off <= file_offset < off + size:
                return file_offset - off + vaddr
        return None

    def containing(self, vaddr: int, path: str | None = None) -> str | None:
        """The function symbol whose [start, start + size) holds ``vaddr``, or None.
        Names are read from ``path`` (default: the file it was parsed from)."""
        for t in self.tables.values():
            k = bisect_right(t.values, vaddr) - 1
            if k >= 0 and t.values[k] <= vaddr < t.values[k] + max(t.sizes[k], 1):
                return self._name(path or self.path, t, t.name_offs[k])
        return None

    def function_at(self, vaddr: int, path: str | None = None) -> tuple[str, str]:
        """(name, table) of the function starting at ``vaddr``; SymbolError if none
        does or the names there disagree. Names are read from ``path`` (another path
        to the same file; default: the one it was parsed from)."""
        try:
            return self._function_at(vaddr, path or self.path)
        except OSError as e:
            raise SymbolError(f"{path or self.path}: cannot read its names: {e}") from e

    def _function_at(self, vaddr: int, path: str) -> tuple[str, str]:
        inside = ""
        for table_name, t in self.tables.items():
            lo = bisect_left(t.values, vaddr)
            hi = bisect_right(t.values, vaddr)
            if hi > lo:
                names = {self._name(path, t, t.name_offs[i]) for i in range(lo, hi)}
                name = _one_name(names)
                if name is None:
                    raise SymbolError(f"{self.path}: {len(names)} names start at {vaddr:#x}: "
                                      + ", ".join(sorted(names)[:4]))
                return name, table_name
            if lo and not inside:
                start, size = t.values[lo - 1], t.sizes[lo - 1]
                if vaddr < start + size:
                    inside = (f" (it is {vaddr - start:#x} into "
                              f"{self._name(path, t, t.name_offs[lo - 1])})")
        if not self.tables:
            raise SymbolError(f"{self.path}: no symbol table (.symtab and .dynsym missing)")
        raise SymbolError(f"{self.path}: no function symbol starts at {vaddr:#x} in "
                          f"{' or '.join(self.tables)}{inside}")

    @staticmethod
    def _name(path: str, t: _Table, off: int) -> str:
        start, size = t.strtab
        if off >= size:
            return ""
        out = b""
        with open(path, "rb") as f:
            f.seek(start + off)
            while b"\0" not in out and len(out) < size - off:
                chunk = f.read(4096)
                if not chunk:
                    break
                out += chunk
        return out.split(b"\0", 1)[0].decode("utf-8", "replace")


def _one_name(names: set[str]) -> str | None:
    """The name several symbols at one address agree on: compiler-made local aliases
    (``f.localalias``) name their function; any other second name makes it ambiguous."""
    base = {n for n in names if not any(n.startswith(o + ".") for o in names if o != n)}
    return base.pop() if len(base) == 1 else None


def _read_table(elf: ELFFile, f, sec) -> _Table:  # type: ignore[no-untyped-def]
    """Defined function symbols of ``sec``, sorted by address."""
    strtab = elf.get_section(sec["sh_link"])
    rows: list[tuple[int, int, int]] = []
    if elf.elfclass == 64 and elf.little_endian and sec["sh_entsize"] == _SYM64.size:
        # struct.iter_unpack: ~50x faster than pyelftools' per-symbol objects, which
        # matters for libraries with 10^5-10^6 symbols (libtorch_cuda.so)
        f.seek(sec["sh_offset"])
        data = f.read(sec["sh_size"] - sec["sh_size"] % _SYM64.size)
        for st_name, info, _other, shndx, value, size in _SYM64.iter_unpack(data):
            if (info & 0xF) in _FUNC_TYPES and shndx != 0 and value:
                rows.append((value, size, st_name))
    else:
        for sym in sec.iter_symbols():
            if (sym["st_info"]["type"] in ("STT_FUNC", "STT_GNU_IFUNC")
                    and sym["st_shndx"] != "SHN_UNDEF" and sym["st_value"]):
                rows.append((sym["st_value"], sym["st_size"], sym["st_name"]))
    rows.sort()
    return _Table(array("Q", (r[0] for r in rows)), array("Q", (r[1] for r in rows)),
                  array("Q", (r[2] for r in rows)), (strtab["sh_offset"], strtab["sh_size"]))


class Symbolizer:
    """Resolves (pid, address) to a function symbol; files are parsed once and kept
    (the ``max_files`` most recently used)."""

    def __init__(self, max_files: int = 32) -> None:
        self.max_files = max_files
        self._files: OrderedDict[tuple[int, int, int, int], ElfFunctions] = OrderedDict()
        self.parses = 0  # files read (cache misses)

    def resolve(self, pid: int, addr: int,
                maps: list[procfs.Mapping] | None = None) -> Symbol:
        """The function symbol starting at ``addr`` in process ``pid``; SymbolError if
        there is none. ``maps``: the process's mappings, if the caller has them."""
        m = _mapping(maps if maps is not None else procfs.mappings(pid), addr)
        if m is None:
            raise SymbolError(f"pid {pid}: {addr:#x} is in no file mapping (process gone, "
                              "or code not from a file)")
        if "x" not in m.perms:
            raise SymbolError(f"pid {pid}: {addr:#x} is in {m.path}, not executable there")
        path = procfs.open_mapped(pid, m)
        elf = self.functions(path)
        file_offset = addr - m.start + m.offset
        vaddr = elf.vaddr_of(file_offset)
        if vaddr is None:
            raise SymbolError(f"{m.path}: file offset {file_offset:#x} is in no PT_LOAD "
                              "segment")
        name, table = elf.function_at(vaddr, path)
        return Symbol(name=name, path=m.path, vaddr=vaddr, table=table)

    def functions(self, path: str) -> ElfFunctions:
        """The (cached) function symbols of the ELF file at ``path``."""
        try:
            st = os.stat(path)
        except OSError as e:
            raise SymbolError(f"{path}: {e.strerror or e}") from e
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        got = self._files.get(key)
        if got is not None:
            self._files.move_to_end(key)
            return got
        try:
            got = ElfFunctions(path)
        except (OSError, ELFError, struct.error) as e:
            raise SymbolError(f"{path}: cannot read its symbols: {e}") from e
        self.parses += 1
        self._files[key] = got
        while len(self._files) > self.max_files:
            self._files.popitem(last=False)
        return got


def _mapping(maps: list[procfs.Mapping], addr: int) -> procfs.Mapping | None:
    for m in maps:
        if m.start <= addr < m.end:
            return m
    return None
