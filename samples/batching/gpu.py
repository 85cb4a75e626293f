"""The driver and NCCL calls an engine step makes when it runs on the stand-ins.

``StandinGpu`` loads a libcuda.so.1 with ctypes (the stand-in built by
``samples/gpu/build.py``) and ``StandinNccl`` a libnccl.so.2; a step copies its input
ids to the device, launches kernels, copies the sampled ids back and synchronises the
stream once, as a real engine's step does.
"""

from __future__ import annotations

import ctypes
import os

# Kernel names a real decoder step launches (mangled as nvcc would), cycled per launch.
KERNELS = [b"_Z15embedding_fwdPKiPKfPfi", b"_Z14layernorm_fwdPKfPfi",
           b"_Z14qkv_gemm_fwdPKfS0_Pfiii", b"_Z15flash_attn_fwdPKfS0_S0_Pfii",
           b"_Z13mlp_gemm_fwdPKfS0_Pfiii", b"_Z11lm_head_fwdPKfS0_Pfii",
           b"_Z10sample_fwdPKfPii"]
NCCL_FLOAT32 = 7
NCCL_SUM = 0


DEFAULT_KERNEL_NS = 200_000  # a block's GPU time in the batching samples


def kernel_ns() -> int:
    """GPU time per block of a launch's grid the stand-in models (its
    TT_STANDIN_KERNEL_NS)."""
    return int(os.environ.get("TT_STANDIN_KERNEL_NS", str(DEFAULT_KERNEL_NS)))


def _check(what: str, rc: int) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} returned {rc}")


class StandinGpu:
    """One context, one function handle per kernel name, device buffers for ids."""

    def __init__(self, path: str, max_ids: int) -> None:
        # the stand-in's kernels run while the host goes on, as a GPU's do, and take
        # longer than this host's forward of the tiny model: a step's GPU time is
        # its kernels' modelled time, whatever the (shared, noisy) host did meanwhile
        os.environ.setdefault("TT_STANDIN_ASYNC", "1")
        os.environ.setdefault("TT_STANDIN_KERNEL_NS", str(DEFAULT_KERNEL_NS))
        self.lib = lib = ctypes.CDLL(path)
        u, vp, ull = ctypes.c_uint, ctypes.c_void_p, ctypes.c_ulonglong
        lib.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
        lib.cuMemcpyHtoD_v2.argtypes = [ull, vp, ctypes.c_size_t]
        lib.cuMemcpyDtoH_v2.argtypes = [vp, ull, ctypes.c_size_t]
        lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ull), ctypes.c_size_t]
        lib.cuStreamSynchronize.argtypes = [vp]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
        _check("cuInit", lib.cuInit(0))
        dev = ctypes.c_int()
        _check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), 0))
        self.ctx = vp()
        _check("cuCtxCreate_v2", lib.cuCtxCreate_v2(ctypes.byref(self.ctx), 0, dev))
        self.fns = []
        for name in KERNELS:
            fn = vp()
            _check("cuModuleGetFunction", lib.cuModuleGetFunction(ctypes.byref(fn), None, name))
            self.fns.append(fn)
        self.d_in = self.alloc(4 * max_ids)
        self.d_out = self.alloc(4 * max_ids)

    def alloc(self, nbytes: int) -> int:
        """A device buffer (cuMemAlloc_v2); returns its address."""
        ptr = ctypes.c_ulonglong()
        _check("cuMemAlloc_v2", self.lib.cuMemAlloc_v2(ctypes.byref(ptr), nbytes))
        return ptr.value

    def copy_in(self, ids: list[int]) -> None:
        """cuMemcpyHtoD_v2 of the step's input ids, 4 bytes each."""
        buf = (ctypes.c_int32 * len(ids))(*ids)
        _check("cuMemcpyHtoD_v2", self.lib.cuMemcpyHtoD_v2(self.d_in, buf, 4 * len(ids)))

    def launch(self, n: int, grid: int = 1) -> int:
        """n cuLaunchKernel calls of ``grid`` blocks on the default stream (the stand-in
        models a kernel's GPU time per block); returns n."""
        for i in range(n):
            fn = self.fns[i % len(self.fns)]
            _check("cuLaunchKernel",
                   self.lib.cuLaunchKernel(fn, grid, 1, 1, 128, 1, 1, 0, None, None, None))
        return n

    def copy_out(self, n: int) -> None:
        """cuMemcpyDtoH_v2 of n sampled ids, 4 bytes each."""
        buf = (ctypes.c_int32 * max(n, 1))()
        _check("cuMemcpyDtoH_v2", self.lib.cuMemcpyDtoH_v2(buf, self.d_out, 4 * n))

    def sync(self) -> None:
        _check("cuStreamSynchronize", self.lib.cuStreamSynchronize(None))


class NcclId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class StandinNccl:
    """A communicator of ``world`` ranks and the step's all-reduce."""

    def __init__(self, path: str) -> None:
        self.lib = lib = ctypes.CDLL(path)
        vp = ctypes.c_void_p
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), ctypes.c_int, NcclId, ctypes.c_int]
        lib.ncclAllReduce.argtypes = [vp, vp, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, vp, vp]
        self.comm = vp()

    def unique_id(self) -> bytes:
        uid = NcclId()
        _check("ncclGetUniqueId", self.lib.ncclGetUniqueId(ctypes.byref(uid)))
        return bytes(uid)

    def init_rank(self, uid: bytes, world: int, rank: int) -> None:
        nid = NcclId.from_buffer_copy(uid.ljust(ctypes.sizeof(NcclId), b"\0"))
        _check("ncclCommInitRank",
               self.lib.ncclCommInitRank(ctypes.byref(self.comm), world, nid, rank))

    def all_reduce(self, dptr: int, count: int) -> None:
        """Sum ``count`` float32 in place across the ranks (the stand-in moves nothing)."""
        _check("ncclAllReduce", self.lib.ncclAllReduce(dptr, dptr, count, NCCL_FLOAT32,
                                                       NCCL_SUM, self.comm, None))
