"""Names for kernel handles resolved before the tracer attached, from what a process's
files and memory hold (tracer/probes/prenames.py), on the CUDA 13-style stand-ins of
samples/gpu/build.py (build_k13): a stripped library whose host stubs keep their
handles in statics filled by __cudaGetKernel, registration code, and a .nv_fatbin of
uncompressed, LZ4 and zstd cubins; "driver objects" that point to their names (and to
the object made before, whose name is another kernel's). No BPF: a real process, read
through /proc/PID/mem, as the agent reads it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from samples.gpu.build import build_k13
from tracer.events import wire
from tracer.probes.fatbin import FatbinError, lz4_block, read_fatbin
from tracer.probes.prenames import PreNames
from tracer.probes.regcode import read_registration

C = wire.CONSTANTS
CHILD = """
import ctypes, json, sys
rt = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
lib = ctypes.CDLL(sys.argv[2])
for k in ("k13_a", "k13_b", "k13_d", "k13_ghost"):  # launched (warmed up); k13_c never
    getattr(lib, k)()
rt.tt_driver_kernel.restype = rt.tt_handle_named.restype = ctypes.c_void_p
rt.tt_driver_kernel(b"_Z11blas_kernelv")  # a driver-API kernel (cuBLAS-like)
rt.tt_driver_kernel(b"triton_poi_fused_9")  # loaded from no cubin we can read
rt.tt_driver_kernel(b"_Z15nvjet_sm90_tstv")  # cuBLASLt's: a cubin of .cask_resource
rt.tt_driver_kernel(b"_Z20cutlass_rodata_kernv")  # in no cubin; in the library's table
rt.tt_driver_kernel(b"ttjet_sm90_hsh_64x48_h")  # in no cubin; made from a library format
rt.tt_driver_kernel(b"ttjet_sm90_hsh_64x48_h_x")  # what that format cannot make
names = ("_Z5k13_av", "_Z5k13_bv", "_Z5k13_dv", "_Z9k13_ghostv", "_Z11blas_kernelv",
         "triton_poi_fused_9", "_Z15nvjet_sm90_tstv", "_Z20cutlass_rodata_kernv",
         "ttjet_sm90_hsh_64x48_h", "ttjet_sm90_hsh_64x48_h_x")
print(json.dumps({n: rt.tt_handle_named(n.encode()) for n in names}), flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def k13(tmp_path_factory):
    return build_k13(tmp_path_factory.mktemp("k13"))


@pytest.fixture
def child(k13):
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(k13["libttk13rt"]),
                          str(k13["libttk13"])], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    handles = json.loads(p.stdout.readline())
    yield p.pid, handles
    p.stdin.close()
    p.wait(10)


def test_fatbin_names_from_uncompressed_lz4_and_zstd_cubins(k13):
    got = read_fatbin(str(k13["libttk13"]), arch=90)
    # kernels only (the device function _Z6helperv is none); sm_80's cubin stands for
    # its container, which has no sm_90 one
    # .cask_resource (cuBLASLt's kernel store) is read like .nv_fatbin, but only the
    # GPU's own cubins (its containers hold one architecture's kernels each)
    assert got.names == {"_Z5k13_av", "_Z5k13_bv", "_Z5k13_cv", "_Z5k13_dv",
                         "_Z11blas_kernelv", "_Z9zstd_kernv", "_Z9sm80_onlyv",
                         "_Z15nvjet_sm90_tstv"}
    assert got.compression == {"none": 2, "lz4": 1, "zstd": 2} and not got.errors
    assert "_Z16nvjet_sm100_tstv" in read_fatbin(str(k13["libttk13"]), arch=100).names
    assert "_Z16nvjet_sm100_tstv" in read_fatbin(str(k13["libttk13"]), arch=None).names
    with pytest.raises(FatbinError, match="bad match offset"):
        lz4_block(bytes([0x10, 0x41, 0x05, 0x00]), 8)  # a match reaching before the start


def test_registration_code_of_a_stripped_library(k13):
    reg = read_registration(str(k13["libttk13"]))
    assert reg.register_calls == 5 and reg.get_kernel_calls == 5 and not reg.dropped
    assert sorted(reg.slot_names().values()) == ["_Z5k13_av", "_Z5k13_bv", "_Z5k13_cv",
                                                 "_Z5k13_dv", "_Z9k13_ghostv"]


def test_handles_named_from_their_stub_slots_and_driver_objects(child):
    pid, handles = child
    pre = PreNames(arch=90)
    names = pre.scan(pid)
    # every launched kernel whose name the cubins confirm; k13_c was never launched
    # (its variable holds 0) and _Z9k13_ghostv is registered but in no cubin
    assert {n.handle: (n.name, n.source) for n in names} == {
        handles[k]: (k, C["NAME_STUB_SLOT"]) for k in ("_Z5k13_av", "_Z5k13_bv", "_Z5k13_dv")}
    assert pre.counts["stub_slot: name not in the library's cubins"] == 1

    driver = ("_Z11blas_kernelv", "triton_poi_fused_9", "_Z9k13_ghostv", "_Z15nvjet_sm90_tstv",
              "_Z20cutlass_rodata_kernv", "ttjet_sm90_hsh_64x48_h", "ttjet_sm90_hsh_64x48_h_x")
    for k in driver:
        pre.on_launched(pid, handles[k])
    got = {n.handle: (n.name, n.source) for n in pre.resolve()}
    # learnt from the three named handles: the name pointer at offset 24; the object
    # made before (offset 8) names other kernels and is rejected
    layout = pre.state()["layouts"][str(pid)]
    assert layout["paths"] == [{"path": [24, 0], "agree": 3}]
    assert any(r["path"] == [8, 24, 0] and r["wrong"] for r in layout["rejected"])
    # a kernel of the loaded cubins is named (driver_object); one in no cubin only if a
    # library's read-only data holds it whole or a format of it makes it (driver_string:
    # the registered-only ghost's name is such a string); nothing else
    assert got == {**{handles[k]: (k, C["NAME_DRIVER_OBJECT"])
                      for k in ("_Z11blas_kernelv", "_Z15nvjet_sm90_tstv")},
                   **{handles[k]: (k, C["NAME_DRIVER_STRING"])
                      for k in ("_Z20cutlass_rodata_kernv", "ttjet_sm90_hsh_64x48_h",
                                "_Z9k13_ghostv")}}
    assert pre.counts["driver_object: string in no cubin or library string"] == 2


def test_no_layout_is_used_without_enough_agreeing_handles(child):
    """Fewer known handles than MIN_AGREE: nothing is named from driver objects."""
    pid, handles = child
    pre = PreNames(arch=90)
    pre.on_named(pid, handles["_Z5k13_av"], "_Z5k13_av")
    pre.on_launched(pid, handles["_Z11blas_kernelv"])
    assert pre.resolve() == []
    assert pre.counts["driver_object: no verified layout"] == 1


def test_the_systems_libzstd_decompresses_without_the_zstandard_wheel():
    """GPU hosts may lack the zstandard wheel; libzstd.so.1 comes with the base system."""
    import zstandard

    from tracer.probes import fatbin
    data = b"cubin " * 5000
    frame = zstandard.ZstdCompressor().compress(data)
    decompress = fatbin._libzstd()
    assert decompress is not None
    assert decompress(frame, len(data)) == data
    with pytest.raises(ValueError, match="zstd"):
        decompress(frame[:-7] + b"garbage", len(data))
