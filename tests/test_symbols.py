"""The symboliser (tracer/probes/symbols.py): process address -> ELF function symbol,
on real binaries built here (non-PIE and PIE executables, shared objects with and
without .symtab), plus the load-bias arithmetic, the cache and the errors."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from tracer.probes import procfs
from tracer.probes.symbols import ElfFunctions, SymbolError, Symbolizer, _one_name

PROG = r"""
#include <stdio.h>
static void __attribute__((noinline)) _Z9tt_localv(void) { __asm__ volatile(""); }
void __attribute__((noinline)) tt_global(void) { __asm__ volatile(""); }
int tt_data = 1;
int main(void)
{
    _Z9tt_localv();
    printf("%p %p %p\n", (void *)_Z9tt_localv, (void *)tt_global, (void *)&tt_data);
    fflush(stdout);
    getchar();
    return 0;
}
"""

LIB = r"""
static void __attribute__((noinline)) tt_lib_local(void) { __asm__ volatile(""); }
void tt_lib_global(void) { tt_lib_local(); }
void *tt_lib_local_address(void) { return (void *)tt_lib_local; }
"""


def _cc(tmp: Path, name: str, src: str, *flags: str) -> Path:
    assert shutil.which("cc"), "a C compiler is needed"
    c = tmp / f"{name}.c"
    c.write_text(src)
    out = tmp / name
    subprocess.run(["cc", "-O1", "-o", str(out), str(c), *flags], check=True)
    return out


def _symbol_value(path: Path, name: str) -> int:
    with open(path, "rb") as f:
        elf = ELFFile(f)
        for table in (".symtab", ".dynsym"):
            sec = elf.get_section_by_name(table)
            for sym in (sec.get_symbol_by_name(name) or []) if sec else []:
                return sym["st_value"]
    raise KeyError(name)


class Running:
    """A built program, started; its printed addresses."""

    def __init__(self, path: Path) -> None:
        self.p = subprocess.Popen([str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        self.local, self.glob, self.data = (int(x, 16) for x in self.p.stdout.readline().split())

    def stop(self) -> None:
        self.p.stdin.write("\n")
        self.p.stdin.close()
        self.p.wait(10)


@pytest.mark.parametrize("pie", [False, True])
def test_executable_functions_resolve_with_their_elf_addresses(tmp_path, pie):
    prog = _cc(tmp_path, "prog", PROG, "-pie" if pie else "-no-pie", "-fPIE" if pie else "-fno-pie")
    run = Running(prog)
    try:
        s = Symbolizer()
        local = s.resolve(run.p.pid, run.local)
        glob = s.resolve(run.p.pid, run.glob)
    finally:
        run.stop()
    assert (local.name, local.table) == ("_Z9tt_localv", ".symtab")
    assert glob.name == "tt_global"
    assert local.vaddr == _symbol_value(prog, "_Z9tt_localv")
    assert glob.vaddr == _symbol_value(prog, "tt_global")
    # a PIE is loaded at a bias: its runtime address is not its ELF address
    assert (run.local != local.vaddr) == pie
    assert local.path == str(prog)


def test_shared_object_in_this_process_with_and_without_symtab(tmp_path):
    full = _cc(tmp_path, "libfull.so", LIB, "-shared", "-fPIC")
    stripped = tmp_path / "libstripped.so"
    shutil.copy(full, stripped)
    subprocess.run(["strip", "-s", str(stripped)], check=True)
    s = Symbolizer()
    for path, table in ((full, ".symtab"), (stripped, ".dynsym")):
        lib = ctypes.CDLL(str(path))
        glob = ctypes.cast(lib.tt_lib_global, ctypes.c_void_p).value
        lib.tt_lib_local_address.restype = ctypes.c_void_p
        local = lib.tt_lib_local_address()
        sym = s.resolve(os.getpid(), glob)
        assert (sym.name, sym.table) == ("tt_lib_global", table)
        assert sym.vaddr == _symbol_value(full, "tt_lib_global")
        if table == ".symtab":
            assert s.resolve(os.getpid(), local).name == "tt_lib_local"
        else:  # stripped: the local function has no symbol anywhere; never a guess
            with pytest.raises(SymbolError, match="no function symbol starts at"):
                s.resolve(os.getpid(), local)
        # not a function's first byte: an error that names where it is
        with pytest.raises(SymbolError, match=r"0x1 into tt_lib_global"):
            s.resolve(os.getpid(), glob + 1)


def test_files_are_read_once_and_again_when_replaced(tmp_path):
    prog = _cc(tmp_path, "prog", PROG)
    runs = [Running(prog), Running(prog)]
    try:
        s = Symbolizer()
        for r in runs:  # two processes, one file: read once
            assert s.resolve(r.p.pid, r.local).name == "_Z9tt_localv"
        assert s.parses == 1
    finally:
        for r in runs:
            r.stop()
    # replaced on disk (a new inode): read again
    os.unlink(prog)
    _cc(tmp_path, "prog", PROG.replace("tt_global", "tt_global2"))
    r = Running(prog)
    try:
        assert s.resolve(r.p.pid, r.glob).name == "tt_global2"
        assert s.parses == 2
    finally:
        r.stop()


def test_errors_say_why_and_never_crash(tmp_path):
    s = Symbolizer()
    with pytest.raises(SymbolError, match=r"/nonexistent/libx\.so: No such file"):
        s.functions("/nonexistent/libx.so")
    notelf = tmp_path / "notelf.so"
    notelf.write_bytes(b"not an ELF file at all" * 10)
    with pytest.raises(SymbolError, match="cannot read its symbols"):
        s.functions(str(notelf))
    prog = _cc(tmp_path, "prog", PROG)
    r = Running(prog)
    try:
        with pytest.raises(SymbolError, match="not executable"):
            s.resolve(r.p.pid, r.data)
        with pytest.raises(SymbolError, match="in no file mapping"):
            s.resolve(r.p.pid, 0x10)
    finally:
        r.stop()
    # the process is gone: its maps are empty
    with pytest.raises(SymbolError, match="in no file mapping"):
        s.resolve(r.p.pid, r.local)
    # its file deleted while it runs: read through /proc/PID/map_files
    r = Running(prog)
    try:
        os.unlink(prog)
        maps = procfs.mappings(r.p.pid)
        assert any(m.path.endswith(" (deleted)") for m in maps)
        assert Symbolizer().resolve(r.p.pid, r.local).name == "_Z9tt_localv"
    finally:
        r.stop()
    # ...and once that process is gone too, an error, not a crash
    with pytest.raises(SymbolError, match="No such file"):
        Symbolizer().resolve(r.p.pid, r.local, maps)


def test_load_bias_arithmetic_from_segments():
    """file offset -> ELF address through PT_LOAD (p_offset, p_filesz, p_vaddr)."""
    elf = ElfFunctions.__new__(ElfFunctions)
    elf.loads = [(0x0, 0x1000, 0x400000), (0x1000, 0x2345, 0x401000), (0x4000, 0x800, 0x605000)]
    assert elf.vaddr_of(0x10) == 0x400010
    assert elf.vaddr_of(0x1234) == 0x401234
    assert elf.vaddr_of(0x4010) == 0x605010  # a segment loaded away from its offset
    assert elf.vaddr_of(0x3400) is None  # between segments: not loaded


def test_aliases_at_one_address():
    assert _one_name({"_Z1fv", "_Z1fv.localalias"}) == "_Z1fv"
    assert _one_name({"_Z1fv"}) == "_Z1fv"
    assert _one_name({"getpid", "__getpid"}) is None  # two names: ambiguous
