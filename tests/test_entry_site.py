"""Entry uprobes go past an ENDBR64 (tracer/probes/entry.py): checked on the stand-in
libcuda, which is built with -fcf-protection=full, and on a build without it."""

from __future__ import annotations

import subprocess

from elftools.elf.elffile import ELFFile

from samples.gpu.build import build
from tracer.probes.entry import ENDBR64, entry_sites, file_offset
from tracer.probes.gpu import exported_functions

SOURCE = "int tt_probe_me(int x) { return x * 3 + 1; }\n"


def first_bytes(path: str, vaddr: int, n: int = 4) -> bytes:
    with open(path, "rb") as f:
        off = file_offset(ELFFile(f), vaddr)
        assert off is not None
        f.seek(off)
        return f.read(n)


def test_the_stand_in_starts_with_endbr64_and_is_probed_past_it(tmp_path):
    lib = str(build(tmp_path / "gpu")["libcuda"])
    plain = exported_functions(lib)
    sites = exported_functions(lib, probe_sites=True)
    assert first_bytes(lib, plain["cuLaunchKernel"]) == ENDBR64
    assert sites["cuLaunchKernel"] == plain["cuLaunchKernel"] + 4
    assert first_bytes(lib, sites["cuLaunchKernel"], 1) == b"\x55"  # push %rbp
    assert all(sites[n] - plain[n] == 4 for n in plain)


def test_a_function_without_endbr64_is_probed_at_its_address(tmp_path):
    src = tmp_path / "f.c"
    src.write_text(SOURCE)
    out = {}
    for flag in ("none", "full"):
        so = tmp_path / f"lib{flag}.so"
        subprocess.run(["cc", "-O0", "-shared", "-fPIC", f"-fcf-protection={flag}", "-o",
                        str(so), str(src)], check=True)
        addr = exported_functions(str(so))["tt_probe_me"]
        out[flag] = entry_sites(str(so), {"f": addr})["f"] - addr
    assert out == {"none": 0, "full": 4}
