"""The kernel names in an ELF file's ``.nv_fatbin`` section (and cuBLASLt's
``.cask_resource``, made of the same containers): every ``__global__`` function of the
cubins embedded there, read from their own symbol tables.

A fat binary is a run of containers (a 16-byte header: magic 0xBA55ED50, version 1,
header size, size of what follows), each a run of entries: a header (kind 2 = cubin,
1 = PTX; its own size; payload size; architecture; flags; compressed and decompressed
sizes) followed by the payload. CUDA 11-12 may compress payloads with LZ4 (flag
0x2000, a raw LZ4 block); CUDA 13 compresses every cubin with zstd (flag 0x8000, a
zstd frame). A cubin is an ELF file whose kernels are function symbols with
STO_CUDA_ENTRY (0x10) in ``st_other``: exactly the names the driver looks kernels up
by (``cuLibraryGetKernel``, ``cuModuleGetFunction``) and reports (the profiler's names,
mangled).

This is the evidence other routes are checked against (tracer/probes/prenames.py): a
string is a kernel name of a library only if one of its cubins says so. Names are the
nearly the same in every architecture's cubin of one container (one translation unit),
so by default only the cubins for ``arch`` (the GPU's) are decompressed, or the first
of a container that has none. On the real 456 MB ``libtorch_cuda.so`` of PyTorch 2.11
+ CUDA 13 that is 448 cubins (~0.6 s, 21,132 names) instead of all 2,789 (4.7 GB
decompressed, ~3.3 s), with the same names; the first cubin of each container alone
would miss 15.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Callable

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

FATBIN_MAGIC = 0xBA55ED50
_CONTAINER = struct.Struct("<IHHQ")  # magic, version, header size, size of the rest
# kind, unknown, header size, payload size, compressed size, options offset, minor,
# major, arch, name offset, name length, flags, zero, decompressed size
_ENTRY = struct.Struct("<HHIQIIHHIIIQQQ")
KIND_PTX, KIND_CUBIN = 1, 2
FLAG_LZ4 = 0x2000
FLAG_ZSTD = 0x8000
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
ELF_MAGIC = b"\x7fELF"
STO_CUDA_ENTRY = 0x10
_SHDR = struct.Struct("<IIQQQQIIQQ")  # Elf64_Shdr
_SYM = struct.Struct("<IBBHQQ")  # Elf64_Sym
SHT_SYMTAB = 2
STT_FUNC = 2


class FatbinError(Exception):
    """A payload that cannot be read (no decoder, corrupt data); the message says why."""


def _zstd_decoder() -> Callable[[bytes | memoryview, int], bytes] | None:
    """A zstd decompressor from whichever module this Python has, or None."""
    try:
        from compression import zstd  # type: ignore[import-not-found]  # Python 3.14+

        return lambda data, size: zstd.decompress(bytes(data))
    except ImportError:
        pass
    try:
        import zstandard

        d = zstandard.ZstdDecompressor()
        return lambda data, size: d.decompress(data, max_output_size=size)
    except ImportError:
        pass
    return _libzstd()


def _libzstd() -> Callable[[bytes | memoryview, int], bytes] | None:
    """The system's libzstd through ctypes (Debian and Ubuntu install it with the base
    system): one call, the decompressed size known from the fatbin's header."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("zstd") or "libzstd.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    lib.ZSTD_decompress.restype = ctypes.c_size_t
    lib.ZSTD_decompress.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p,
                                    ctypes.c_size_t]
    lib.ZSTD_isError.restype = ctypes.c_uint
    lib.ZSTD_isError.argtypes = [ctypes.c_size_t]
    lib.ZSTD_getErrorName.restype = ctypes.c_char_p
    lib.ZSTD_getErrorName.argtypes = [ctypes.c_size_t]

    def decompress(data: bytes | memoryview, size: int) -> bytes:
        src = bytes(data)
        out = ctypes.create_string_buffer(size)
        n = lib.ZSTD_decompress(out, size, src, len(src))
        if lib.ZSTD_isError(n):
            raise ValueError(f"zstd: {lib.ZSTD_getErrorName(n).decode()}")
        return out.raw[:n]

    return decompress


_ZSTD = _zstd_decoder()


def lz4_block(src: bytes | memoryview, size: int) -> bytes:
    """Decompress one raw LZ4 block (no frame) of ``size`` bytes decompressed."""
    out = bytearray()
    i, n = 0, len(src)
    while i < n:
        token = src[i]
        i += 1
        lit = token >> 4
        if lit == 15:
            while True:
                b = src[i]
                i += 1
                lit += b
                if b != 255:
                    break
        out += src[i:i + lit]
        i += lit
        if i >= n:
            break  # the last sequence has literals only
        back = src[i] | (src[i + 1] << 8)
        i += 2
        if back == 0 or back > len(out):
            raise FatbinError(f"lz4: bad match offset {back} at output {len(out)}")
        mlen = (token & 15) + 4
        if mlen == 19:
            while True:
                b = src[i]
                i += 1
                mlen += b
                if b != 255:
                    break
        start = len(out) - back
        if back >= mlen:
            out += out[start:start + mlen]
        else:  # overlapping copy: a repeated pattern
            for k in range(mlen):
                out.append(out[start + k])
    if len(out) != size:
        raise FatbinError(f"lz4: {len(out)} bytes decompressed, the header says {size}")
    return bytes(out)


def cubin_kernels(elf: bytes) -> set[str]:
    """The kernel (STO_CUDA_ENTRY function) names in one cubin's symbol table."""
    if elf[:4] != ELF_MAGIC or elf[4] != 2 or elf[5] != 1:
        raise FatbinError("cubin is not a 64-bit little-endian ELF")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    if shentsize != _SHDR.size or shoff + shnum * shentsize > len(elf):
        raise FatbinError("cubin section headers out of bounds")
    secs = [_SHDR.unpack_from(elf, shoff + i * shentsize) for i in range(shnum)]
    names: set[str] = set()
    for s in secs:
        if s[1] != SHT_SYMTAB or s[6] >= shnum:
            continue
        str_off, str_size = secs[s[6]][4], secs[s[6]][5]
        off, size = s[4], s[5]
        if off + size > len(elf) or str_off + str_size > len(elf):
            raise FatbinError("cubin symbol table out of bounds")
        for st_name, info, other, _shndx, _value, _size in _SYM.iter_unpack(
                elf[off:off + size - size % _SYM.size]):
            if (info & 0xF) == STT_FUNC and other & STO_CUDA_ENTRY and st_name < str_size:
                end = elf.find(b"\0", str_off + st_name, str_off + str_size)
                if end > str_off + st_name:
                    names.add(elf[str_off + st_name:end].decode("utf-8", "replace"))
    return names


@dataclass
class FatbinNames:
    """What one file's ``.nv_fatbin`` holds, and what reading it cost."""

    path: str
    names: set[str] = field(default_factory=set)
    containers: int = 0
    cubins: int = 0  # cubin entries in the file
    cubins_read: int = 0  # of those, decompressed and read
    decompressed_bytes: int = 0
    compression: dict[str, int] = field(default_factory=dict)  # "zstd"/"lz4"/"none" -> cubins
    errors: dict[str, int] = field(default_factory=dict)  # reason -> cubins not read
    seconds: float = 0.0

    def summary(self) -> dict[str, object]:
        """For reports and benchmarks (no names)."""
        return {"path": self.path, "names": len(self.names), "containers": self.containers,
                "cubins": self.cubins, "cubins_read": self.cubins_read,
                "decompressed_mb": round(self.decompressed_bytes / 1e6, 1),
                "compression": dict(self.compression), "errors": dict(self.errors),
                "seconds": round(self.seconds, 3)}


def _payload(buf: mmap.mmap | bytes, at: int, hdr: tuple[int, ...]) -> tuple[str, bytes]:
    """(compression, the cubin's bytes) of the entry whose payload starts at ``at``."""
    _kind, _u, _hs, psize, csize, _o, _mi, _ma, _arch, _no, _nl, flags, _z, dsize = hdr
    raw = memoryview(buf)[at:at + psize]
    try:
        if raw[:4] == ELF_MAGIC:
            return "none", bytes(raw)
        if raw[:4] == ZSTD_MAGIC or flags & FLAG_ZSTD:
            if _ZSTD is None:
                raise FatbinError("zstd-compressed cubin and no zstd module (pip install "
                                  "zstandard)")
            try:
                return "zstd", _ZSTD(raw[:csize or psize], dsize)
            except Exception as e:  # the decoders' own error classes differ
                raise FatbinError(f"zstd: {e}") from e
        if flags & FLAG_LZ4:
            try:
                return "lz4", lz4_block(raw[:csize or psize], dsize)
            except IndexError as e:
                raise FatbinError("lz4: truncated block") from e
        raise FatbinError(f"unknown payload (flags {flags:#x})")
    finally:
        raw.release()


# Sections made of fat binary containers: nvcc's, and cuBLASLt's own kernel store
# (libcublasLt.so.13: 383 containers of zstd cubins, its nvjet_* and cutlass_* kernels,
# which its .nv_fatbin does not hold)
FATBIN_SECTIONS = (".nv_fatbin", ".cask_resource")


def read_fatbin(path: str, arch: int | None = None, every_cubin: bool = False) -> FatbinNames:
    """The kernel names of the cubins in ``path``'s fat binary sections (empty if it
    has none): of the cubins for ``arch`` (a container with none: its first), or of
    all of them."""
    t0 = time.perf_counter()
    out = FatbinNames(path)
    with open(path, "rb") as f:
        try:
            elf = ELFFile(f)
            sections = [elf.get_section_by_name(n) for n in FATBIN_SECTIONS]
        except (ELFError, struct.error) as e:
            out.errors[f"not an ELF file: {e}"] = 1
            return out
        size = os.fstat(f.fileno()).st_size
        ranges = []
        for name, sec in zip(FATBIN_SECTIONS, sections):
            if sec is None or sec["sh_type"] == "SHT_NOBITS" or not sec["sh_size"]:
                continue
            start, end = sec["sh_offset"], sec["sh_offset"] + sec["sh_size"]
            if end > size:
                out.errors["section past the end of the file"] = 1
                continue
            ranges.append((start, end, name == ".nv_fatbin"))
        if ranges:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                for start, end, first_for_all in ranges:
                    _read_section(mm, start, end, out, arch, every_cubin, first_for_all)
    out.seconds = time.perf_counter() - t0
    return out


def _read_section(mm: mmap.mmap, start: int, end: int, out: FatbinNames, arch: int | None,
                  every_cubin: bool, first_for_all: bool = True) -> None:
    """``first_for_all``: a container with no cubin for ``arch`` is read from its first
    (nvcc's: one translation unit's kernels in every architecture); else it is skipped
    (cuBLASLt's .cask_resource: each container one architecture's own kernels, 1.5 GB
    of sm_100/sm_120 cubins that an H100 never runs)."""
    off = start
    while off + _CONTAINER.size <= end:
        magic, _version, hsize, size = _CONTAINER.unpack_from(mm, off)
        if magic != FATBIN_MAGIC:
            off += 8  # containers are 8-byte aligned; padding between them
            continue
        out.containers += 1
        e, stop = off + hsize, min(off + hsize + size, end)
        cubins: list[tuple[int, tuple[int, ...]]] = []
        while e + _ENTRY.size <= stop:
            hdr = _ENTRY.unpack_from(mm, e)
            kind, ehs, psize = hdr[0], hdr[2], hdr[3]
            if ehs < _ENTRY.size or e + ehs + psize > stop:
                out.errors["entry out of bounds"] = out.errors.get("entry out of bounds", 0) + 1
                break
            if kind == KIND_CUBIN:
                cubins.append((e + ehs, hdr))
            e += ehs + psize
        out.cubins += len(cubins)
        if not every_cubin and cubins:
            # a container may hold several cubins of one architecture (cuBLASLt's do):
            # all of the GPU's are read; where it has none, the first stands for all
            cubins = [c for c in cubins if c[1][8] == arch] or (
                cubins[:1] if first_for_all or arch is None else [])
        for at, hdr in cubins:
            try:
                how, elf = _payload(mm, at, hdr)
                names = cubin_kernels(elf)
            except FatbinError as e:
                why = str(e)
                out.errors[why] = out.errors.get(why, 0) + 1
                continue
            out.compression[how] = out.compression.get(how, 0) + 1
            out.cubins_read += 1
            out.decompressed_bytes += len(elf)
            out.names |= names
        off = max(stop, off + 8)
