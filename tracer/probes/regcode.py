"""What a library's CUDA registration code says about its kernels, read from the machine
code (x86-64), with or without symbols.

nvcc emits, for each translation unit, a static initialiser that calls

    __cudaRegisterFunction(handle, hostFun, deviceFun, deviceName, -1, 0, 0, 0, 0, 0)

once per kernel: ``hostFun`` is the kernel's host stub (``lea stub(%rip), %rsi``) and
``deviceFun`` its mangled device name, a string constant (``lea str(%rip), %rdx``). Since
CUDA 13 (unless ``__NV_LEGACY_LAUNCH``) each host stub also keeps the kernel's handle in
a static of its own, filled once by

    __cudaGetKernel(&__handle, stub)            lea stub(%rip), %rsi; lea __handle(%rip), %rdi

and launches with ``cudaLaunchKernel(__handle, ...)``: the runtime and the driver are
given the handle (a ``cudaKernel_t``, which is the driver's ``CUkernel``), never the stub.
So the handle of every kernel a process has launched sits in a known variable of the
library (``.bss``), whose name the registration code gives: reading those variables
through /proc/PID/mem names every handle resolved before the tracer came
(tracer/probes/prenames.py).

Both calls are found the same way: the callee is the import's PLT entry (``call
rel32``) or GOT slot (``call *GOT(%rip)``), or, where the runtime is linked statically,
a function symbol of that name. The constant arguments are the nearest ``lea
disp32(%rip), %reg`` (or, in a non-PIE executable, ``mov $imm32, %e<reg>``) before the
call and after the previous such call. A found pair is kept only if it makes sense: a
stub in code, a name that is a NUL-terminated string in the file, a handle variable in
writable data, 8-byte aligned. Every stub of a ``__cudaGetKernel`` call must also be a
registered stub (two independent call sites agree), one stub has one name, and one
handle variable one stub; anything else is dropped and counted, never guessed.

Measured on the real ``libtorch_cuda.so`` (PyTorch 2.11 + CUDA 13, 456 MB, 58 MB of
code): 21,495 registration calls and 39,834 ``__cudaGetKernel`` calls (the stub is
inlined into several callers, each with the call, one handle variable), found in about
a second; checked against the file's own ``.symtab``
(``tests/test_regcode.py`` does the same on a stand-in).
"""

from __future__ import annotations

import mmap
import struct
import time
from dataclasses import dataclass, field

import numpy as np
from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

REGISTER = "__cudaRegisterFunction"
GET_KERNEL = "__cudaGetKernel"
WINDOW = 64  # bytes before a call searched for its arguments
_REG = {"rdi": 7, "rsi": 6, "rdx": 2, "rcx": 1}
_PF_X, _PF_W = 1, 2
_MAX_NAME = 4096


class RegcodeError(Exception):
    """A file whose registration code cannot be read; the message says why."""


@dataclass
class Registration:
    """One library file's kernels as its registration code states them (ELF
    virtual addresses)."""

    path: str
    names: dict[int, str] = field(default_factory=dict)  # host stub -> device name
    slots: dict[int, int] = field(default_factory=dict)  # handle variable -> host stub
    register_calls: int = 0
    get_kernel_calls: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # why -> calls not used
    seconds: float = 0.0
    loads: list[tuple[int, int, int, int]] = field(default_factory=list)  # off, filesz, vaddr, memsz

    def slot_names(self) -> dict[int, str]:
        """Handle variable -> the device name of its kernel."""
        return {slot: self.names[stub] for slot, stub in self.slots.items()
                if stub in self.names}

    def vaddr_of(self, file_offset: int) -> int | None:
        """The ELF virtual address ``file_offset`` is loaded at, or None."""
        for off, size, vaddr, _mem in self.loads:
            if off <= file_offset < off + size:
                return file_offset - off + vaddr
        return None

    def summary(self) -> dict[str, object]:
        """For reports and benchmarks."""
        return {"path": self.path, "register_calls": self.register_calls,
                "get_kernel_calls": self.get_kernel_calls, "stubs": len(self.names),
                "handle_variables": len(self.slots), "dropped": dict(self.dropped),
                "seconds": round(self.seconds, 3)}

    def _drop(self, why: str, n: int = 1) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + n


class _Image:
    """The loaded view of an ELF file: read bytes by virtual address."""

    def __init__(self, mm: mmap.mmap, loads: list[tuple[int, int, int, int, int]]) -> None:
        self.mm = mm
        self.loads = loads  # (offset, filesz, vaddr, memsz, flags)

    def segment(self, vaddr: int) -> tuple[int, int, int, int, int] | None:
        for seg in self.loads:
            if seg[2] <= vaddr < seg[2] + seg[3]:
                return seg
        return None

    def string(self, vaddr: int) -> str | None:
        """The NUL-terminated printable string at ``vaddr`` in the file, or None."""
        seg = self.segment(vaddr)
        if seg is None or vaddr >= seg[2] + seg[1]:
            return None
        at = seg[0] + vaddr - seg[2]
        end = self.mm.find(b"\0", at, min(at + _MAX_NAME, seg[0] + seg[1]))
        if end <= at:
            return None
        raw = self.mm[at:end]
        if not all(0x21 <= b < 0x7F for b in raw):
            return None
        return raw.decode("ascii")


_RELA = struct.Struct("<QQq")  # Elf64_Rela
_SYM = struct.Struct("<IBBHQQ")  # Elf64_Sym


def _symbols_named(f, elf: ELFFile, sec, want: tuple[str, ...]  # type: ignore[no-untyped-def]
                   ) -> dict[int, tuple[str, int, int, int]]:
    """Index -> (name, st_info, st_shndx, st_value) of the symbols of ``sec`` named in
    ``want``, read raw: pyelftools' per-symbol parsing takes ~20 s for the 235k symbols
    of libtorch_cuda.so."""
    strtab = elf.get_section(sec["sh_link"])
    f.seek(strtab["sh_offset"])
    strings = f.read(strtab["sh_size"])
    offsets: dict[int, str] = {}
    for name in want:
        key = b"\0" + name.encode() + b"\0"
        at = strings.find(key)
        while at >= 0:
            offsets[at + 1] = name
            at = strings.find(key, at + 1)
        if strings.startswith(key[1:]):
            offsets[0] = name
    out: dict[int, tuple[str, int, int, int]] = {}
    if not offsets:
        return out
    f.seek(sec["sh_offset"])
    raw = f.read(sec["sh_size"] - sec["sh_size"] % _SYM.size)
    for i, (st_name, info, _other, shndx, value, _size) in enumerate(_SYM.iter_unpack(raw)):
        name = offsets.get(st_name)
        if name is not None:
            out[i] = (name, info, shndx, value)
    return out


def _callees(f, elf: ELFFile, want: tuple[str, ...]  # type: ignore[no-untyped-def]
             ) -> tuple[dict[int, str], dict[int, str]]:
    """(call targets -> name, GOT slots -> name) for the functions in ``want``: their PLT
    entries, the GOT slots that ``call *GOT(%rip)`` goes through, and their own
    definitions where the runtime is linked in."""
    got: dict[int, str] = {}
    tables: dict[int, dict[int, tuple[str, int, int, int]]] = {}
    for sec in elf.iter_sections():
        if sec["sh_type"] != "SHT_RELA" or not sec["sh_link"]:
            continue
        link = sec["sh_link"]
        if link not in tables:
            symtab = elf.get_section(link)
            if symtab is None or symtab["sh_type"] not in ("SHT_DYNSYM", "SHT_SYMTAB"):
                continue
            tables[link] = _symbols_named(f, elf, symtab, want)
        named = tables[link]
        if not named:
            continue
        f.seek(sec["sh_offset"])
        raw = f.read(sec["sh_size"] - sec["sh_size"] % _RELA.size)
        for r_offset, r_info, _addend in _RELA.iter_unpack(raw):
            hit = named.get(r_info >> 32)
            if hit:
                got[r_offset] = hit[0]
    targets: dict[int, str] = {}
    for sec in elf.iter_sections():
        if not sec.name.startswith(".plt") or not sec["sh_flags"] & 4:  # SHF_EXECINSTR
            continue
        data = sec.data()
        base = sec["sh_addr"]
        pos = data.find(b"\xff\x25")
        while pos >= 0:
            if pos + 6 <= len(data):
                disp = struct.unpack_from("<i", data, pos + 2)[0]
                name = got.get(base + pos + 6 + disp)
                if name:
                    start = pos - 1 if pos and data[pos - 1] == 0xF2 else pos  # bnd jmp
                    for entry in (start, start - 4, start - start % 16, start - start % 8):
                        if entry >= 0:
                            targets[base + entry] = name
            pos = data.find(b"\xff\x25", pos + 1)
    for tab in (".symtab", ".dynsym"):
        sec = elf.get_section_by_name(tab)
        if sec is None or sec["sh_type"] == "SHT_NOBITS":
            continue
        for name, info, shndx, value in _symbols_named(f, elf, sec, want).values():
            if info & 0xF == 2 and shndx != 0 and value:  # STT_FUNC, defined here
                targets[value] = name
    return targets, got


def got_values(f, elf: ELFFile) -> dict[int, int]:  # type: ignore[no-untyped-def]
    """GOT slot -> the address the dynamic linker puts there, where the file decides it:
    R_X86_64_RELATIVE (the addend) and GLOB_DAT/64 of a symbol defined in the file. PIC
    code takes the address of an exported (interposable) stub from such a slot."""
    out: dict[int, int] = {}
    values: dict[int, list[tuple[int, int]]] = {}  # symtab section -> [(shndx, value)]
    for sec in elf.iter_sections():
        if sec["sh_type"] != "SHT_RELA" or not sec.name.startswith(".rela.dyn"):
            continue
        link = sec["sh_link"]
        if link and link not in values:
            symtab = elf.get_section(link)
            f.seek(symtab["sh_offset"])
            raw = f.read(symtab["sh_size"] - symtab["sh_size"] % _SYM.size)
            values[link] = [(sh, v) for _n, _i, _o, sh, v, _s in _SYM.iter_unpack(raw)]
        syms = values.get(link, [])
        f.seek(sec["sh_offset"])
        raw = f.read(sec["sh_size"] - sec["sh_size"] % _RELA.size)
        for r_offset, r_info, addend in _RELA.iter_unpack(raw):
            kind, idx = r_info & 0xFFFFFFFF, r_info >> 32
            if kind == 8:  # R_X86_64_RELATIVE
                out[r_offset] = addend
            elif kind in (1, 6) and idx < len(syms) and syms[idx][0]:  # 64, GLOB_DAT
                out[r_offset] = syms[idx][1] + addend
    return out


def _calls(code: np.ndarray, base: int, targets: dict[int, str],
           got: dict[int, str]) -> list[tuple[int, str]]:
    """(position in ``code``, callee) of every ``call rel32`` to a target and every
    ``call *disp(%rip)`` through a GOT slot of ``got``."""
    out: list[tuple[int, str]] = []
    n = len(code)
    if n < 6:
        return out
    for opcode, length, table in ((np.uint8(0xE8), 5, targets), (None, 6, got)):
        if not table:
            continue
        if opcode is not None:
            at = np.flatnonzero(code[:n - 4] == opcode)
            disp_at = at + 1
        else:
            at = np.flatnonzero((code[:n - 5] == 0xFF) & (code[1:n - 4] == 0x15))
            disp_at = at + 2
        disp = (code[disp_at].astype(np.int64) | (code[disp_at + 1].astype(np.int64) << 8)
                | (code[disp_at + 2].astype(np.int64) << 16)
                | (code[disp_at + 3].astype(np.int64) << 24))
        disp = np.where(disp >= 1 << 31, disp - (1 << 32), disp)
        dest = base + at + length + disp
        keys = np.fromiter(table.keys(), dtype=np.int64, count=len(table))
        hit = np.isin(dest, keys)
        for pos, d in zip(at[hit].tolist(), dest[hit].tolist()):
            out.append((pos, table[d]))
    out.sort()
    return out


def _arguments(raw: bytes, at: int, absolute: bool, gots: dict[int, int]) -> dict[int, int]:
    """Register number -> the constant that the last ``lea disp32(%rip), %reg`` in
    ``raw`` (the bytes before a call, which starts at virtual address ``at``) loads, or
    the last ``mov disp32(%rip), %reg`` from a GOT slot of ``gots``; with ``absolute``
    (a non-PIE executable) also ``mov $imm32, %e<reg>``."""
    found: dict[int, tuple[int, int]] = {}  # reg -> (position, value)
    n = len(raw)
    for opcode in (b"\x8d", b"\x8b"):  # lea, mov from memory
        i = raw.find(opcode, 1)
        while 0 < i <= n - 6:
            rex, modrm = raw[i - 1], raw[i + 1]
            if rex in (0x48, 0x4C) and modrm & 0xC7 == 0x05:
                reg = ((modrm >> 3) & 7) | (8 if rex == 0x4C else 0)
                target = at - n + i + 6 + struct.unpack_from("<i", raw, i + 2)[0]
                value = target if opcode == b"\x8d" else gots.get(target)
                if value is not None and found.get(reg, (-1, 0))[0] < i:
                    found[reg] = (i, value)
                elif value is None and found.get(reg, (-1, 0))[0] < i:
                    found[reg] = (i, -1)  # loaded from memory we cannot know: no constant
            i = raw.find(opcode, i + 1)
    if absolute:
        for i in range(n - 4):
            if 0xB8 <= raw[i] <= 0xBF and not (i and 0x40 <= raw[i - 1] <= 0x4F):
                if found.get(raw[i] - 0xB8, (-1, 0))[0] < i:
                    found[raw[i] - 0xB8] = (i, struct.unpack_from("<I", raw, i + 1)[0])
    return {reg: value for reg, (_pos, value) in found.items() if value >= 0}


def read_registration(path: str) -> Registration:
    """The registered kernels and CUDA 13 handle variables of the ELF file at ``path``
    (empty where it has no such code, or is not x86-64)."""
    t0 = time.perf_counter()
    out = Registration(path)
    with open(path, "rb") as f:
        try:
            elf = ELFFile(f)
            if elf["e_machine"] != "EM_X86_64":
                out._drop(f"not x86-64 ({elf['e_machine']})")
                return out
            absolute = elf["e_type"] == "ET_EXEC"
            loads = [(s["p_offset"], s["p_filesz"], s["p_vaddr"], s["p_memsz"], s["p_flags"])
                     for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
            out.loads = [ld[:4] for ld in loads]
            targets, got = _callees(f, elf, (REGISTER, GET_KERNEL))
            if not targets and not got:
                return out
            gots = got_values(f, elf)
            code_secs = [(s["sh_offset"], s["sh_size"], s["sh_addr"])
                         for s in elf.iter_sections()
                         if s["sh_flags"] & 4 and s["sh_type"] == "SHT_PROGBITS"
                         and not s.name.startswith(".plt")]
        except (ELFError, struct.error) as e:
            raise RegcodeError(f"{path}: {e}") from e
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            img = _Image(mm, loads)
            gets: list[tuple[int, int]] = []  # (handle variable, stub)
            for off, size, addr in code_secs:
                code = np.frombuffer(mm, dtype=np.uint8, count=size, offset=off)
                prev = 0
                for pos, callee in _calls(code, addr, targets, got):
                    start = max(prev, pos - WINDOW)
                    args = _arguments(mm[off + start:off + pos], addr + pos, absolute, gots)
                    prev = pos + 5
                    if callee == REGISTER:
                        out.register_calls += 1
                        _take_register(out, img, args)
                    else:
                        out.get_kernel_calls += 1
                        got_pair = _take_get_kernel(out, img, args)
                        if got_pair:
                            gets.append(got_pair)
                del code
        _join(out, gets)
    out.seconds = time.perf_counter() - t0
    return out


def _is_code(img: _Image, vaddr: int) -> bool:
    seg = img.segment(vaddr)
    return seg is not None and bool(seg[4] & _PF_X) and vaddr < seg[2] + seg[1]


def _take_register(out: Registration, img: _Image, args: dict[int, int]) -> None:
    stub = args.get(_REG["rsi"])
    name_at = args.get(_REG["rdx"], args.get(_REG["rcx"]))
    if stub is None or name_at is None:
        out._drop("register: stub or name not a constant")
        return
    if not _is_code(img, stub):
        out._drop("register: stub not in code")
        return
    name = img.string(name_at)
    if name is None:
        out._drop("register: name not a string")
        return
    known = out.names.get(stub)
    if known is not None and known != name:
        out._drop("register: one stub, two names")
        out.names[stub] = ""  # poisoned: never named
        return
    out.names[stub] = name


def _take_get_kernel(out: Registration, img: _Image,
                     args: dict[int, int]) -> tuple[int, int] | None:
    slot, stub = args.get(_REG["rdi"]), args.get(_REG["rsi"])
    if slot is None or stub is None:
        out._drop("get_kernel: handle variable or stub not a constant")
        return None
    seg = img.segment(slot)
    if seg is None or not seg[4] & _PF_W or slot % 8:
        out._drop("get_kernel: handle variable not in writable data")
        return None
    if not _is_code(img, stub):
        out._drop("get_kernel: stub not in code")
        return None
    return slot, stub


def _join(out: Registration, gets: list[tuple[int, int]]) -> None:
    """Handle variable -> stub, where every call agrees and the stub is registered."""
    by_slot: dict[int, set[int]] = {}
    for slot, stub in gets:
        by_slot.setdefault(slot, set()).add(stub)
    for slot, stubs in by_slot.items():
        if len(stubs) != 1:
            out._drop("get_kernel: one handle variable, several stubs", len(stubs))
            continue
        stub = next(iter(stubs))
        if not out.names.get(stub):
            out._drop("get_kernel: stub not registered (or registered twice)")
            continue
        out.slots[slot] = stub
    for stub in [s for s, n in out.names.items() if not n]:
        del out.names[stub]
