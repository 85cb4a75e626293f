"""Build the GPU stand-ins (libcuda.so.1, libnccl.so.2, libcudart.so.12,
libibverbs.so.1 and its provider) and the sample workloads.

``build(out_dir)``, ``build_stubs(out_dir)`` and ``build_verbs(out_dir)`` compile them
with the system C compiler and return the paths; nothing is rebuilt when the sources
have not changed. The
workloads link against the stand-ins by soname, with an rpath to ``out_dir``, exactly
as a CUDA or RDMA program links against the real libraries.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VERBS_SOURCES = [HERE / "standin" / "libibverbs.c", HERE / "standin" / "libttsim.c",
                 HERE / "standin" / "ttsim.h", HERE / "standin" / "libibverbs.map",
                 HERE / "standin" / "verbs_abi_check.c", HERE / "verbs_workload.c",
                 ROOT / "bpf" / "ibverbs.c"]
VERBS_HEADER = Path("/usr/include/infiniband/verbs.h")
STUB_SOURCES = [HERE / "standin" / "libcudart.c", HERE / "stub_kernels.c",
                HERE / "stub_workload.c", HERE / "standin" / "cudart.h",
                HERE / "standin" / "counts.h"]
SOURCES = [HERE / "standin" / "libcuda.c", HERE / "standin" / "libnccl.c", HERE / "workload.c",
           HERE / "standin" / "counts.h"]
# -O0: every function keeps its own body at its own address with a push first, as in a
# real driver. (-O2 merges identical bodies and starts leaf functions with a
# lock-prefixed add, an instruction x86 uprobes refuse to probe.)
# -fcf-protection=full: every function starts with ENDBR64, as in distributions that
# build with CET (Ubuntu's gcc default), so the tests cover the tracer's probe placement
# past it (tracer/probes/entry.py).
CFLAGS = ["-O0", "-g", "-fPIC", "-fcf-protection=full", "-Wall", "-Wno-unused-parameter"]


class BuildError(RuntimeError):
    """No C compiler, or the stand-ins failed to compile."""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise BuildError("no C compiler: apt-get install gcc libc6-dev (`make setup` does)")
    return cc


def _runner(cc: str):  # type: ignore[no-untyped-def]
    def run(*args: str) -> None:
        r = subprocess.run([cc, *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"{' '.join(args)}:\n{r.stderr}")
    return run


def build(out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Build libcuda.so.1, libnccl.so.2 and the CUDA workload into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cc = _compiler()
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)
                            + " ".join(CFLAGS).encode()).hexdigest()[:16]
    paths = {"libcuda": out / "libcuda.so.1", "libnccl": out / "libnccl.so.2",
             "workload": out / "workload"}
    stamp = out / ".built"
    if stamp.exists() and stamp.read_text() == digest and all(p.exists() for p in paths.values()):
        return paths

    run = _runner(cc)
    run(*CFLAGS, "-shared", "-Wl,-soname,libcuda.so.1", "-o", str(paths["libcuda"]),
        str(SOURCES[0]), "-lpthread")
    run(*CFLAGS, "-shared", "-Wl,-soname,libnccl.so.2", "-o", str(paths["libnccl"]),
        str(SOURCES[1]))
    for link, target in (("libcuda.so", "libcuda.so.1"), ("libnccl.so", "libnccl.so.2")):
        (out / link).unlink(missing_ok=True)
        (out / link).symlink_to(target)
    # DT_RPATH, not DT_RUNPATH: searched before LD_LIBRARY_PATH, so that on a GPU host
    # (LD_LIBRARY_PATH naming the real driver) the workload still loads the stand-ins
    run("-O2", "-g", "-o", str(paths["workload"]), str(SOURCES[2]), f"-L{out}",
        f"-Wl,-rpath,{out}", "-Wl,--disable-new-dtags", "-lcuda", "-lnccl", "-lpthread")
    stamp.write_text(digest)
    return paths


def build_stubs(out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Build the stand-in libcudart.so.12 and the host-stub naming workload (with
    ``build``'s libcuda.so.1): ``stub_workload``, a PIE whose own host stubs are in its
    .symtab only, linked against ``libttkernels.so``, stripped, whose exported stubs
    are in .dynsym only and one static stub in no symbol table at all."""
    paths = build(out_dir)
    out = Path(out_dir)
    cc = _compiler()
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in STUB_SOURCES)
                            + " ".join(CFLAGS).encode()).hexdigest()[:16]
    paths = {**paths, "libcudart": out / "libcudart.so.12",
             "libttkernels": out / "libttkernels.so", "stub_workload": out / "stub_workload"}
    stamp = out / ".built-stubs"
    if stamp.exists() and stamp.read_text() == digest and all(p.exists() for p in paths.values()):
        return paths
    run = _runner(cc)
    run(*CFLAGS, "-shared", "-Wl,-soname,libcudart.so.12", "-o", str(paths["libcudart"]),
        str(STUB_SOURCES[0]), f"-L{out}", "-lcuda", "-lpthread")
    (out / "libcudart.so").unlink(missing_ok=True)
    (out / "libcudart.so").symlink_to("libcudart.so.12")
    run("-O2", "-fPIC", "-shared", "-s", "-Wl,-soname,libttkernels.so", "-o",
        str(paths["libttkernels"]), str(STUB_SOURCES[1]), f"-I{HERE}", f"-L{out}", "-lcudart")
    run("-O2", "-g", "-pie", "-fPIE", "-o", str(paths["stub_workload"]), str(STUB_SOURCES[2]),
        f"-I{HERE}", f"-L{out}", f"-Wl,-rpath,{out}", "-Wl,--disable-new-dtags", "-lttkernels",
        "-lcudart", "-lcuda")
    stamp.write_text(digest)
    return paths


K13_SOURCES = [HERE / "standin" / "k13rt.c", HERE / "k13_kernels.c", HERE / "standin" / "k13.h",
               Path(__file__)]
# the cubins of libttk13.so's .nv_fatbin: (arch, compression, kernels, device functions)
K13_CUBINS = [(90, "none", ["_Z5k13_av", "_Z5k13_bv"], ["_Z6helperv"]),
              (90, "lz4", ["_Z5k13_cv", "_Z5k13_dv", "_Z11blas_kernelv"], []),
              (90, "zstd", ["_Z9zstd_kernv"], []),
              (80, "none", ["_Z9sm80_onlyv"], [])]
# its .cask_resource (cuBLASLt keeps its own kernels there, in the same containers)
K13_CASK = [(90, "zstd", ["_Z15nvjet_sm90_tstv"], []),
            (100, "zstd", ["_Z16nvjet_sm100_tstv"], [])]  # another GPU's: skipped


def cubin(kernels: list[str], functions: list[str]) -> bytes:
    """A cubin-like ELF (EM_CUDA) whose symbol table holds ``kernels`` (STO_CUDA_ENTRY)
    and ``functions`` (device functions, not kernels)."""
    import struct

    strtab = b"\0"
    syms = [bytes(24)]
    for name, other in [(k, 0x10) for k in kernels] + [(f, 0) for f in functions]:
        syms.append(struct.pack("<IBBHQQ", len(strtab), 0x12, other, 1, 0, 64))
        strtab += name.encode() + b"\0"
    shstr = b"\0.shstrtab\0.strtab\0.symtab\0"
    body = shstr + strtab + b"".join(syms)
    off_shstr, off_str = 64, 64 + len(shstr)
    off_sym = off_str + len(strtab)
    shoff = 64 + len(body)
    shoff += -shoff % 8
    sh = [bytes(64),
          struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, off_shstr, len(shstr), 0, 0, 1, 0),
          struct.pack("<IIQQQQIIQQ", 11, 3, 0, 0, off_str, len(strtab), 0, 0, 1, 0),
          struct.pack("<IIQQQQIIQQ", 19, 2, 0, 0, off_sym, 24 * len(syms), 2, 1, 8, 24)]
    ident = b"\x7fELF\x02\x01\x01" + bytes(9)
    head = ident + struct.pack("<HHIQQQIHHHHHH", 1, 190, 1, 0, 0, shoff, 0, 64, 0, 0, 64,
                               len(sh), 1)
    out = head + body
    return out + bytes(shoff - len(out)) + b"".join(sh)


def lz4_compress(data: bytes) -> bytes:
    """A raw LZ4 block of ``data`` (greedy, 4-byte matches), for the stand-in's fatbin."""
    out = bytearray()

    def length(n: int) -> None:
        while n >= 255:
            out.append(255)
            n -= 255
        out.append(n)

    last: dict[bytes, int] = {}
    i = anchor = 0
    while i + 12 <= len(data):
        key = data[i:i + 4]
        j = last.get(key)
        last[key] = i
        if j is None or i - j > 65535:
            i += 1
            continue
        m = 4
        while i + m + 5 < len(data) and data[j + m] == data[i + m]:
            m += 1
        lit = i - anchor
        out.append((min(lit, 15) << 4) | min(m - 4, 15))
        if lit >= 15:
            length(lit - 15)
        out += data[anchor:i]
        out += (i - j).to_bytes(2, "little")
        if m - 4 >= 15:
            length(m - 4 - 15)
        i += m
        anchor = i
    lit = len(data) - anchor
    out.append(min(lit, 15) << 4)
    if lit >= 15:
        length(lit - 15)
    out += data[anchor:]
    return bytes(out)


def k13_fatbin(cubins: list[tuple[int, str, list[str], list[str]]] = K13_CUBINS) -> bytes:
    """The stand-in's .nv_fatbin (or, given K13_CASK, .cask_resource): one container
    per cubin."""
    import struct

    out = b""
    for arch, how, kernels, functions in cubins:
        raw = cubin(kernels, functions)
        flags, payload = 0x11, raw
        if how == "lz4":
            flags, payload = 0x2011, lz4_compress(raw)
        elif how == "zstd":
            import zstandard

            flags, payload = 0x8011, zstandard.ZstdCompressor().compress(raw)
        padded = payload + bytes(-len(payload) % 8)
        entry = struct.pack("<HHIQIIHHIIIQQQ", 2, 0x101, 64, len(padded),
                            len(payload) if how != "none" else 0, 0, 0, 0, arch, 0, 0, flags,
                            0, len(raw) if how != "none" else 0)
        out += struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(entry) + len(padded))
        out += entry + padded
    return out


def build_k13(out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Build the CUDA 13-style stand-ins: ``libttk13rt.so`` (registration,
    __cudaGetKernel and driver objects) and ``libttk13.so`` (stripped; host stubs that
    keep their handles, registration code, a .nv_fatbin of uncompressed, LZ4 and zstd
    cubins)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cc = _compiler()
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in K13_SOURCES)).hexdigest()[:16]
    paths = {"libttk13rt": out / "libttk13rt.so", "libttk13": out / "libttk13.so"}
    stamp = out / ".built-k13"
    if stamp.exists() and stamp.read_text() == digest and all(p.exists() for p in paths.values()):
        return paths
    inc = out / "k13_fatbin.inc"
    inc.write_text(",".join(str(b) for b in k13_fatbin()) + "\n")
    (out / "k13_cask.inc").write_text(",".join(str(b) for b in k13_fatbin(K13_CASK)) + "\n")
    run = _runner(cc)
    run("-O2", "-fPIC", "-shared", "-Wl,-soname,libttk13rt.so", "-o", str(paths["libttk13rt"]),
        str(K13_SOURCES[0]))
    run("-O2", "-fPIC", "-shared", "-s", "-Wl,-soname,libttk13.so", "-o", str(paths["libttk13"]),
        str(K13_SOURCES[1]), f"-I{HERE}", f"-I{out}", f"-L{out}", "-lttk13rt")
    stamp.write_text(digest)
    return paths


def verbs_abi_flags() -> list[str]:
    """The TT_VERBS_* offsets and constants of bpf/ibverbs.c as -D flags."""
    text = (ROOT / "bpf" / "ibverbs.c").read_text()
    return [f"-D{name}={value}" for name, value in
            re.findall(r"^#define (TT_VERBS_\w+) (\d+)", text, re.M)]


def build_verbs(out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Build the stand-in libibverbs.so.1, its provider libibverbs/libttsim-rdmav34.so
    (stripped) and the RDMA workload, all against the real <infiniband/verbs.h>; first
    prove that bpf/ibverbs.c's offsets are that header's."""
    if not VERBS_HEADER.exists():
        raise BuildError(f"{VERBS_HEADER} is missing: apt-get install libibverbs-dev")
    out = Path(out_dir)
    (out / "libibverbs").mkdir(parents=True, exist_ok=True)
    cc = _compiler()
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in VERBS_SOURCES)
                            + VERBS_HEADER.read_bytes() + " ".join(CFLAGS).encode()
                            ).hexdigest()[:16]
    paths = {"libibverbs": out / "libibverbs.so.1",
             "provider": out / "libibverbs" / "libttsim-rdmav34.so",
             "workload": out / "verbs_workload"}
    stamp = out / ".built-verbs"
    if stamp.exists() and stamp.read_text() == digest and all(p.exists() for p in paths.values()):
        return paths
    run = _runner(cc)
    std = HERE / "standin"
    run("-fsyntax-only", *verbs_abi_flags(), str(std / "verbs_abi_check.c"))
    run(*CFLAGS, "-shared", "-Wl,-soname,libibverbs.so.1",
        f"-Wl,--version-script={std / 'libibverbs.map'}", "-o", str(paths["libibverbs"]),
        str(std / "libibverbs.c"), "-ldl")
    (out / "libibverbs.so").unlink(missing_ok=True)
    (out / "libibverbs.so").symlink_to("libibverbs.so.1")
    run(*CFLAGS, "-shared", "-s", "-Wl,-soname,libttsim-rdmav34.so", "-o",
        str(paths["provider"]), str(std / "libttsim.c"), f"-L{out}", "-libverbs", "-lpthread")
    run("-O2", "-g", "-o", str(paths["workload"]), str(HERE / "verbs_workload.c"), f"-L{out}",
        f"-Wl,-rpath,{out}", "-Wl,--disable-new-dtags", "-libverbs", "-lpthread")
    stamp.write_text(digest)
    return paths


if __name__ == "__main__":
    where = sys.argv[1] if len(sys.argv) > 1 else "build/gpu"
    for k, v in build_stubs(where).items():
        print(k, v)
    for k, v in build_verbs(where).items():
        print(f"verbs {k}", v)


PATHS_SOURCES = [HERE / "flame_paths.c"]


def build_paths(out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """``build``'s stand-ins and ``libttpaths.so`` (flame_paths.c): known native call
    paths to the driver for the flame graph tests, built as CUDA's and PyTorch's
    libraries are, optimised and without frame pointers (only .eh_frame unwinds them)."""
    paths = build(out_dir)
    out = Path(out_dir)
    cc = _compiler()
    flags = ["-O2", "-g", "-fPIC", "-fomit-frame-pointer", "-fcf-protection=full", "-Wall"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in PATHS_SOURCES)
                            + " ".join(flags).encode()).hexdigest()[:16]
    paths = {**paths, "libttpaths": out / "libttpaths.so"}
    stamp = out / ".built-paths"
    if stamp.exists() and stamp.read_text() == digest and paths["libttpaths"].exists():
        return paths
    _runner(cc)(*flags, "-shared", "-Wl,-soname,libttpaths.so", "-o", str(paths["libttpaths"]),
                str(PATHS_SOURCES[0]), f"-L{out}", f"-Wl,-rpath,{out}",
                "-Wl,--disable-new-dtags", "-lcuda")
    stamp.write_text(digest)
    return paths
