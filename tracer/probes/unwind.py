"""Native stack unwinding from a copied stack slice, with the libraries' ``.eh_frame``.

At a sampled GPU call bpf/stacks.c sends, once per new stack, the registers at the
probe (instruction, stack and frame pointer) and the first bytes of the user stack.
CUDA's, cuBLAS's and PyTorch's libraries are built without frame pointers, so walking
``%rbp`` (what ``bpf_get_stackid`` does) stops after a frame or two; but every x86-64
ELF file carries ``.eh_frame`` call-frame information for C++ exceptions, which says at
every instruction where the caller's frame starts (the CFA) and where the return
address and saved registers are. So: for each frame, find the FDE covering its address
through ``.eh_frame_hdr``'s sorted table (or a scan of ``.eh_frame`` where there is no
header), run its CFA program up to the address, read the return address and ``%rbp``
from the slice, and go on with the caller, until the interpreter (``libpython`` or the
``python`` executable: from there the Python frames take over), the end of the slice,
or an address without unwind information (then frame pointers are tried, if ``%rbp``
points into the slice).

Supported CFA rules: CFA = ``%rsp`` or ``%rbp`` + offset, registers saved at CFA +
offset. A CFA computed by a DWARF expression (PLT entries, realigned stacks) stops
the walk, as does one in another register; the reason is kept per stack.
"""

from __future__ import annotations

import mmap
import os
import struct
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

RSP, RBP, RA = 7, 6, 16
MAX_FRAMES = 96


class UnwindError(Exception):
    """Unwind information that cannot be used."""


def _uleb(b: bytes | mmap.mmap, i: int) -> tuple[int, int]:
    val = shift = 0
    while True:
        x = b[i]
        i += 1
        val |= (x & 0x7F) << shift
        shift += 7
        if not x & 0x80:
            return val, i


def _sleb(b: bytes | mmap.mmap, i: int) -> tuple[int, int]:
    val = shift = 0
    while True:
        x = b[i]
        i += 1
        val |= (x & 0x7F) << shift
        shift += 7
        if not x & 0x80:
            if x & 0x40:
                val -= 1 << shift
            return val, i


_FIXED = {0x00: ("<Q", 8), 0x02: ("<H", 2), 0x03: ("<I", 4), 0x04: ("<Q", 8),
          0x0A: ("<h", 2), 0x0B: ("<i", 4), 0x0C: ("<q", 8)}


@dataclass
class _Cie:
    code_align: int
    data_align: int
    ra_reg: int
    fde_enc: int
    initial: bytes
    has_z: bool  # FDEs carry an augmentation data length


@dataclass
class Rules:
    """Where, at one instruction, the caller's frame and saved registers are."""

    cfa_reg: int
    cfa_off: int
    saved: dict[int, int] = field(default_factory=dict)  # register -> CFA offset
    expression: bool = False  # CFA given by a DWARF expression: not supported


class EhFrame:
    """The call-frame information of one ELF file (read through mmap, parsed lazily)."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            elf = ELFFile(f)
            self.loads = [(s["p_offset"], s["p_filesz"], s["p_vaddr"])
                          for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
            hdr = elf.get_section_by_name(".eh_frame_hdr")
            eh = elf.get_section_by_name(".eh_frame")
            self.eh_addr = eh["sh_addr"] if eh is not None else 0
            self.eh_size = eh["sh_size"] if eh is not None else 0
            self.hdr_addr = hdr["sh_addr"] if hdr is not None else 0
        self._cies: dict[int, _Cie] = {}
        self._starts: list[int] = []
        self._fdes: list[int] = []
        if self.hdr_addr:
            self._read_hdr()
        elif self.eh_addr:
            self._scan()

    # ---- reading the file by virtual address -----------------------------------------

    def _off(self, vaddr: int) -> int:
        for off, size, va in self.loads:
            if va <= vaddr < va + size:
                return vaddr - va + off
        raise UnwindError(f"{vaddr:#x} is not in the file")

    def _enc(self, enc: int, vaddr: int) -> tuple[int, int]:
        """Decode a DW_EH_PE-encoded pointer at ``vaddr``; (value, vaddr after it)."""
        if enc == 0xFF:
            return 0, vaddr
        i = self._off(vaddr)
        fmt = enc & 0x0F
        if fmt == 0x01:
            val, j = _uleb(self.map, i)
        elif fmt == 0x09:
            val, j = _sleb(self.map, i)
        elif fmt in _FIXED:
            code, n = _FIXED[fmt]
            val, j = struct.unpack_from(code, self.map, i)[0], i + n
        else:
            raise UnwindError(f"pointer encoding {enc:#x}")
        app = enc & 0x70
        if app == 0x10:
            val += vaddr
        elif app == 0x30:
            val += self.hdr_addr
        elif app != 0:
            raise UnwindError(f"pointer application {app:#x}")
        if enc & 0x80:
            raise UnwindError("indirect pointer")
        return val & 0xFFFFFFFFFFFFFFFF, vaddr + (j - i)

    # ---- the FDE table ---------------------------------------------------------------

    def _read_hdr(self) -> None:
        i = self._off(self.hdr_addr)
        version, ptr_enc, count_enc, table_enc = self.map[i:i + 4]
        if version != 1:
            raise UnwindError(f".eh_frame_hdr version {version}")
        _, a = self._enc(ptr_enc, self.hdr_addr + 4)
        count, a = self._enc(count_enc, a)
        if table_enc == 0x3B:  # datarel | sdata4, what every linker writes: bulk-read it
            j = self._off(a)
            pairs = struct.unpack_from(f"<{2 * count}i", self.map, j)
            self._starts = [x + self.hdr_addr for x in pairs[0::2]]
            self._fdes = [x + self.hdr_addr for x in pairs[1::2]]
            return
        for _ in range(count):
            start, a = self._enc(table_enc, a)
            fde, a = self._enc(table_enc, a)
            self._starts.append(start)
            self._fdes.append(fde)

    def _scan(self) -> None:
        """No header: walk .eh_frame for its FDEs."""
        rows = []
        a, end = self.eh_addr, self.eh_addr + self.eh_size
        while a < end:
            i = self._off(a)
            length = struct.unpack_from("<I", self.map, i)[0]
            if length == 0:
                break
            head = 4
            if length == 0xFFFFFFFF:
                length = struct.unpack_from("<Q", self.map, i + 4)[0]
                head = 12
            cie_id = struct.unpack_from("<I", self.map, i + head)[0]
            if cie_id != 0:
                try:
                    start, _ = self._fde_range(a)
                    rows.append((start, a))
                except (UnwindError, struct.error, IndexError):
                    pass
            a += head + length
        rows.sort()
        self._starts = [r[0] for r in rows]
        self._fdes = [r[1] for r in rows]

    def _cie(self, vaddr: int) -> _Cie:
        got = self._cies.get(vaddr)
        if got is not None:
            return got
        i = self._off(vaddr)
        length = struct.unpack_from("<I", self.map, i)[0]
        head = 4
        if length == 0xFFFFFFFF:
            length = struct.unpack_from("<Q", self.map, i + 4)[0]
            head = 12
        end = i + head + length
        j = i + head + 4  # past the CIE id
        version = self.map[j]
        j += 1
        k = self.map.find(b"\0", j)
        aug = bytes(self.map[j:k]).decode("ascii", "replace")
        j = k + 1
        if "eh" in aug:
            j += 8
        code_align, j = _uleb(self.map, j)
        data_align, j = _sleb(self.map, j)
        if version == 1:
            ra = self.map[j]
            j += 1
        else:
            ra, j = _uleb(self.map, j)
        fde_enc = 0
        if aug.startswith("z"):
            alen, j = _uleb(self.map, j)
            after = j + alen
            for ch in aug[1:]:
                if ch == "R":
                    fde_enc = self.map[j]
                    j += 1
                elif ch == "L":
                    j += 1
                elif ch == "P":
                    penc = self.map[j]
                    va = vaddr + (j + 1 - i)
                    _, va2 = self._enc(penc & 0x7F, va)
                    j = j + 1 + (va2 - va)
                elif ch in "SB":
                    continue
                else:
                    break
            j = after
        cie = _Cie(code_align, data_align, ra, fde_enc, bytes(self.map[j:end]),
                   aug.startswith("z"))
        self._cies[vaddr] = cie
        return cie

    def _fde_range(self, vaddr: int) -> tuple[int, int]:
        i = self._off(vaddr)
        length = struct.unpack_from("<I", self.map, i)[0]
        head = 4 if length != 0xFFFFFFFF else 12
        ptr_at = vaddr + head
        cie_ptr = struct.unpack_from("<I", self.map, i + head)[0]
        cie = self._cie(ptr_at - cie_ptr)
        start, a = self._enc(cie.fde_enc, ptr_at + 4)
        rng, _ = self._enc(cie.fde_enc & 0x0F, a)
        return start, rng

    def rules(self, vaddr: int) -> Rules | None:
        """The CFA rules at ``vaddr``, or None if no FDE covers it."""
        k = bisect_right(self._starts, vaddr) - 1
        if k < 0:
            return None
        fde = self._fdes[k]
        i = self._off(fde)
        length = struct.unpack_from("<I", self.map, i)[0]
        head = 4
        if length == 0xFFFFFFFF:
            length = struct.unpack_from("<Q", self.map, i + 4)[0]
            head = 12
        end = i + head + length
        ptr_at = fde + head
        cie = self._cie(ptr_at - struct.unpack_from("<I", self.map, i + head)[0])
        start, a = self._enc(cie.fde_enc, ptr_at + 4)
        rng, a = self._enc(cie.fde_enc & 0x0F, a)
        if not start <= vaddr < start + rng:
            return None
        j = self._off(a)
        if cie.has_z:
            alen, j = _uleb(self.map, j)
            j += alen
        rules = Rules(RSP, 8)
        _run(cie.initial, cie, rules, start, None, [])
        _run(bytes(self.map[j:end]), cie, rules, start, vaddr, [])
        return rules


def _run(prog: bytes, cie: _Cie, r: Rules, loc: int, until: int | None,
         stack: list[tuple[int, int, dict[int, int], bool]]) -> None:
    """Execute CFA instructions, stopping once the location passes ``until``."""
    i = 0
    init = dict(r.saved)
    while i < len(prog):
        op = prog[i]
        i += 1
        hi, lo = op & 0xC0, op & 0x3F
        if hi == 0x40:  # advance_loc
            loc += lo * cie.code_align
            if until is not None and loc > until:
                return
            continue
        if hi == 0x80:  # offset
            off, i = _uleb(prog, i)
            r.saved[lo] = off * cie.data_align
            continue
        if hi == 0xC0:  # restore
            r.saved.pop(lo, None)
            if lo in init:
                r.saved[lo] = init[lo]
            continue
        if op == 0x00:  # nop
            continue
        if op in (0x02, 0x03, 0x04):  # advance_loc1/2/4
            n = {0x02: 1, 0x03: 2, 0x04: 4}[op]
            delta = int.from_bytes(prog[i:i + n], "little")
            i += n
            loc += delta * cie.code_align
            if until is not None and loc > until:
                return
        elif op == 0x01:  # set_loc: absolute, encoded; rare in .eh_frame
            raise UnwindError("DW_CFA_set_loc")
        elif op in (0x05, 0x11):  # offset_extended(_sf)
            reg, i = _uleb(prog, i)
            off, i = (_uleb if op == 0x05 else _sleb)(prog, i)
            r.saved[reg] = off * cie.data_align
        elif op == 0x06:  # restore_extended
            reg, i = _uleb(prog, i)
            r.saved.pop(reg, None)
            if reg in init:
                r.saved[reg] = init[reg]
        elif op in (0x07, 0x08):  # undefined, same_value
            reg, i = _uleb(prog, i)
            r.saved.pop(reg, None)
        elif op == 0x09:  # register
            reg, i = _uleb(prog, i)
            _, i = _uleb(prog, i)
            r.saved.pop(reg, None)
        elif op == 0x0A:  # remember_state
            stack.append((r.cfa_reg, r.cfa_off, dict(r.saved), r.expression))
        elif op == 0x0B:  # restore_state
            if stack:
                r.cfa_reg, r.cfa_off, r.saved, r.expression = stack.pop()
        elif op == 0x0C:  # def_cfa
            r.cfa_reg, i = _uleb(prog, i)
            r.cfa_off, i = _uleb(prog, i)
            r.expression = False
        elif op == 0x0D:  # def_cfa_register
            r.cfa_reg, i = _uleb(prog, i)
            r.expression = False
        elif op == 0x0E:  # def_cfa_offset
            r.cfa_off, i = _uleb(prog, i)
        elif op == 0x0F:  # def_cfa_expression
            n, i = _uleb(prog, i)
            i += n
            r.expression = True
        elif op in (0x10, 0x16):  # expression, val_expression
            reg, i = _uleb(prog, i)
            n, i = _uleb(prog, i)
            i += n
            r.saved.pop(reg, None)
        elif op == 0x12:  # def_cfa_sf
            r.cfa_reg, i = _uleb(prog, i)
            off, i = _sleb(prog, i)
            r.cfa_off = off * cie.data_align
            r.expression = False
        elif op == 0x13:  # def_cfa_offset_sf
            off, i = _sleb(prog, i)
            r.cfa_off = off * cie.data_align
        elif op in (0x14, 0x15):  # val_offset(_sf)
            reg, i = _uleb(prog, i)
            _, i = (_uleb if op == 0x14 else _sleb)(prog, i)
            r.saved.pop(reg, None)
        elif op == 0x2E:  # GNU_args_size
            _, i = _uleb(prog, i)
        elif op == 0x2F:  # GNU_negative_offset_extended
            reg, i = _uleb(prog, i)
            off, i = _uleb(prog, i)
            r.saved[reg] = -off * cie.data_align
        else:
            raise UnwindError(f"CFA instruction {op:#x}")


@dataclass(frozen=True)
class Region:
    """An executable file mapping of the process: where its addresses come from."""

    start: int
    end: int
    bias: int  # process address - ELF virtual address
    path: str  # as mapped
    open_path: str  # what to open (through /proc/PID/root)
    inode: int = 0  # the mapped file's inode: ``path`` may stand in once the process is gone

    def usable_path(self) -> str | None:
        """A path that opens the mapped file now: through the process while it lives,
        else the same file by its own path (same inode), else None."""
        if os.path.exists(self.open_path):
            return self.open_path
        try:
            if self.inode and os.stat(self.path).st_ino == self.inode:
                return self.path
        except OSError:
            pass
        return None


@dataclass
class Unwound:
    """Return addresses (innermost first: the probed function's entry, its caller...)
    and why the walk stopped (``interpreter``: it reached libpython, as it should)."""

    pcs: list[int]
    stop: str


class Unwinder:
    """Unwinds stack slices of processes; files' call-frame information is cached."""

    def __init__(self, max_files: int = 64) -> None:
        self.max_files = max_files
        self._files: OrderedDict[tuple[int, int, int], EhFrame | None] = OrderedDict()
        self.errors: dict[str, str] = {}

    def eh(self, path: str) -> EhFrame | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino, st.st_mtime_ns)
        if key in self._files:
            self._files.move_to_end(key)
            return self._files[key]
        try:
            got: EhFrame | None = EhFrame(path)
        except (OSError, ELFError, UnwindError, struct.error, ValueError) as e:
            self.errors[path] = str(e)
            got = None
        self._files[key] = got
        while len(self._files) > self.max_files:
            self._files.popitem(last=False)
        return got

    def unwind(self, regions: list[Region], ip: int, sp: int, bp: int, stack: bytes,
               stop_at: set[str]) -> Unwound:
        """Walk from the probed instruction ``ip`` (stack pointer ``sp``, frame pointer
        ``bp``, ``stack`` = the bytes at ``sp``) outwards; stop in a region whose path
        is in ``stop_at`` (the interpreter)."""
        starts = [r.start for r in regions]

        def region_of(a: int) -> Region | None:
            k = bisect_right(starts, a) - 1
            return regions[k] if k >= 0 and a < regions[k].end else None

        def read(a: int) -> int | None:
            o = a - sp
            if 0 <= o and o + 8 <= len(stack):
                return int.from_bytes(stack[o:o + 8], "little")
            return None

        pcs: list[int] = []
        pc, rsp, rbp = ip, sp, bp
        for depth in range(MAX_FRAMES):
            reg = region_of(pc)
            if reg is None:
                return Unwound(pcs, "address in no file mapping" if depth else "no mapping")
            if reg.path in stop_at:
                return Unwound(pcs, "interpreter")
            pcs.append(pc)
            usable = reg.usable_path()
            eh = self.eh(usable) if usable else None
            rules = None
            if eh is not None:
                try:
                    rules = eh.rules(pc - reg.bias - (1 if depth else 0))
                except (UnwindError, struct.error, IndexError) as e:
                    self.errors[reg.path] = str(e)
            if rules is not None and not rules.expression and rules.cfa_reg in (RSP, RBP):
                cfa = (rsp if rules.cfa_reg == RSP else rbp) + rules.cfa_off
                ra_off = rules.saved.get(RA, -8)
                ra = read(cfa + ra_off)
                if RBP in rules.saved:
                    saved = read(cfa + rules.saved[RBP])
                    if saved is not None:
                        rbp = saved
                rsp = cfa
            elif rules is not None:
                return Unwound(pcs, "CFA by expression" if rules.expression
                               else f"CFA in register {rules.cfa_reg}")
            else:  # no unwind information: try the frame pointer
                ra = read(rbp + 8) if rbp > rsp else None
                if ra is None:
                    return Unwound(pcs, "no unwind info")
                nxt = read(rbp)
                rsp, rbp = rbp + 16, nxt or 0
            if ra is None:
                return Unwound(pcs, "stack slice ends")
            if ra == 0:
                return Unwound(pcs, "end of stack")
            pc = ra
        return Unwound(pcs, "too deep")
