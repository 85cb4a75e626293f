"""Attach the CUDA and NCCL uprobes (bpf/cuda.c, bpf/nccl.c) to the libraries that the
traced processes map.

Libraries are found per process in ``/proc/PID/maps`` and opened through
``/proc/PID/root`` so that a containerised process's own copy is probed. A uprobe
belongs to a file (inode), not a process, so each library file is attached once and the
kernel-side pid filter decides whose calls count. Symbols sharing one address (NCCL's
``pncclX`` aliases) are attached once, so no call is counted twice.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from tracer.probes import procfs


@dataclass(frozen=True)
class Probe:
    symbol: str
    entry: str | None  # BPF function at entry
    ret: str | None = None  # BPF function at return


def _each(symbols: str, entry: str | None, ret: str | None = None) -> list[Probe]:
    return [Probe(s, entry, ret) for s in symbols.split()]


# libcuda.so.1: the driver API. Variants that do not exist in a given driver are skipped.
CUDA_PROBES: list[Probe] = [
    *_each("cuLaunchKernel cuLaunchKernel_ptsz cuLaunchCooperativeKernel "
           "cuLaunchCooperativeKernel_ptsz", "tt_launch_arg1"),
    *_each("cuLaunchKernelEx cuLaunchKernelEx_ptsz", "tt_launch_arg2"),
    *_each("cuGraphLaunch cuGraphLaunch_ptsz", "tt_graph_launch"),
    *_each("cuMemcpyHtoD_v2 cuMemcpyHtoD_v2_ptds cuMemcpyHtoDAsync_v2 "
           "cuMemcpyHtoDAsync_v2_ptsz", "tt_copy_h2d_arg3"),
    *_each("cuMemcpyDtoH_v2 cuMemcpyDtoH_v2_ptds cuMemcpyDtoHAsync_v2 "
           "cuMemcpyDtoHAsync_v2_ptsz", "tt_copy_d2h_arg3"),
    *_each("cuMemcpyDtoD_v2 cuMemcpyDtoD_v2_ptds cuMemcpyDtoDAsync_v2 "
           "cuMemcpyDtoDAsync_v2_ptsz", "tt_copy_d2d_arg3"),
    *_each("cuMemcpy cuMemcpy_ptds cuMemcpyAsync cuMemcpyAsync_ptsz", "tt_copy_other_arg3"),
    *_each("cuMemcpyPeer cuMemcpyPeer_ptds cuMemcpyPeerAsync cuMemcpyPeerAsync_ptsz",
           "tt_copy_d2d_arg5"),
    *_each("cuMemsetD8_v2 cuMemsetD8_v2_ptds cuMemsetD8Async cuMemsetD8Async_ptsz",
           "tt_memset8_arg3"),
    *_each("cuMemsetD16_v2 cuMemsetD16_v2_ptds cuMemsetD16Async cuMemsetD16Async_ptsz",
           "tt_memset16_arg3"),
    *_each("cuMemsetD32_v2 cuMemsetD32_v2_ptds cuMemsetD32Async cuMemsetD32Async_ptsz",
           "tt_memset32_arg3"),
    *_each("cuStreamSynchronize cuStreamSynchronize_ptsz", "tt_sync_stream", "tt_sync_return"),
    *_each("cuEventSynchronize", "tt_sync_event", "tt_sync_return"),
    # cudaDeviceSynchronize goes through cuCtxSynchronize_v2 on CUDA 13 (seen on an H200,
    # driver 580): without it, a device-wide sync would not end the thread's burst
    *_each("cuCtxSynchronize cuCtxSynchronize_v2", "tt_sync_ctx", "tt_sync_return"),
    *_each("cuStreamQuery cuStreamQuery_ptsz cuEventQuery", None, "tt_query_return"),
    *_each("cuModuleGetFunction", "tt_module_get_function", "tt_name_return"),
    *_each("cuLibraryGetKernel", "tt_library_get_kernel", "tt_name_return"),
    *_each("cuKernelGetFunction", "tt_kernel_get_function", "tt_name_return"),
    *_each("cuMemAlloc_v2 cuMemAllocAsync cuMemAllocAsync_ptsz cuMemAllocFromPoolAsync "
           "cuMemAllocFromPoolAsync_ptsz cuMemAllocManaged", "tt_alloc", "tt_alloc_return"),
    *_each("cuMemFree_v2 cuMemFreeAsync cuMemFreeAsync_ptsz", "tt_free"),
]

NCCL_PROBES: list[Probe] = [
    Probe("ncclAllReduce", "tt_nccl_allreduce", "tt_nccl_return"),
    Probe("ncclAllGather", "tt_nccl_allgather", "tt_nccl_return"),
    Probe("ncclReduceScatter", "tt_nccl_reducescatter", "tt_nccl_return"),
    Probe("ncclBroadcast", "tt_nccl_broadcast", "tt_nccl_return"),
    Probe("ncclReduce", "tt_nccl_reduce", "tt_nccl_return"),
    Probe("ncclSend", "tt_nccl_send", "tt_nccl_return"),
    Probe("ncclRecv", "tt_nccl_recv", "tt_nccl_return"),
    Probe("ncclGroupStart", "tt_nccl_group_start", "tt_nccl_return"),
    Probe("ncclGroupEnd", "tt_nccl_group_end", "tt_nccl_return"),
    Probe("ncclCommInitRank", "tt_nccl_comm_init", "tt_nccl_return"),
    Probe("ncclCommInitRankConfig", "tt_nccl_comm_init", "tt_nccl_return"),
]

# libcudart: only device-wide synchronisation, which does not pass through an exported
# libcuda function on CUDA 13 (seen on an H200, driver 580). Launches are never probed
# here: they all reach cuLaunchKernel*, and probing both would count them twice.
CUDART_PROBES: list[Probe] = [
    Probe("cudaDeviceSynchronize", "tt_sync_ctx", "tt_sync_return"),
]

LIBRARIES: dict[str, tuple[re.Pattern[str], list[Probe]]] = {
    "cuda": (re.compile(r"/libcuda\.so(\.\d+)*$"), CUDA_PROBES),
    "cudart": (re.compile(r"/libcudart\.so(\.\d+)*$"), CUDART_PROBES),
    "nccl": (re.compile(r"/libnccl\.so(\.\d+)*$"), NCCL_PROBES),
}


@dataclass
class AttachedLibrary:
    kind: str
    path: str  # as opened (through /proc/PID/root)
    probes: int  # uprobes + uretprobes attached
    symbols: list[str]
    missing: list[str]


class GpuProbes:
    """Finds CUDA/NCCL libraries in traced processes and attaches to each file once."""

    def __init__(self, bpf: Any) -> None:
        self.bpf = bpf
        self.attached: dict[tuple[int, int], AttachedLibrary] = {}  # (dev, inode) -> lib
        self.errors: dict[str, str] = {}

    def scan(self, pid: int) -> list[AttachedLibrary]:
        """Attach to the GPU libraries ``pid`` maps that are not attached yet."""
        new = []
        for path in procfs.maps(pid):
            for kind, (pattern, probes) in LIBRARIES.items():
                if pattern.search(path):
                    lib = self._attach_file(kind, f"/proc/{pid}/root{path}", probes)
                    if lib is not None:
                        new.append(lib)
        return new

    def _attach_file(self, kind: str, path: str, probes: list[Probe]) -> AttachedLibrary | None:
        try:
            st = os.stat(path)
        except OSError as e:
            self.errors[path] = str(e)
            return None
        key = (st.st_dev, st.st_ino)
        if key in self.attached:
            return None
        addresses = self._exported_functions(path)
        done: dict[int, str] = {}  # address -> first symbol attached there
        lib = AttachedLibrary(kind, path, 0, [], [])
        for p in probes:
            addr = addresses.get(p.symbol)
            if addr is None:
                lib.missing.append(p.symbol)
                continue
            if addr in done:  # an alias of a symbol already probed
                continue
            done[addr] = p.symbol
            try:
                if p.entry:
                    self.bpf.attach_uprobe(name=path.encode(), sym=p.symbol.encode(),
                                           fn_name=p.entry.encode())
                    lib.probes += 1
                if p.ret:
                    self.bpf.attach_uretprobe(name=path.encode(), sym=p.symbol.encode(),
                                              fn_name=p.ret.encode())
                    lib.probes += 1
            except Exception as e:  # BCC raises bare Exception on attach failure
                self.errors[f"{path}:{p.symbol}"] = str(e)
                continue
            lib.symbols.append(p.symbol)
        self.attached[key] = lib
        return lib

    def _exported_functions(self, path: str) -> dict[str, int]:
        import bcc  # type: ignore[import-not-found]

        out: dict[str, int] = {}
        try:
            pairs = bcc.BPF.get_user_functions_and_addresses(path.encode(), b".*")
        except Exception as e:
            self.errors[path] = f"cannot read its symbols: {e}"
            return out
        for name, addr in pairs:
            out.setdefault(name.decode(), addr)
        return out

    def drain(self) -> list[bytes]:
        """The bursts still open in the kernel, as KBURST records (reason DRAIN), removed
        from the map: called once capture stops so that counts are exact."""
        import ctypes

        from tracer.events import wire

        table = self.bpf[b"bursts"]
        out = []
        reason_off = wire.KBURST.offsets["reason"]
        for k, v in list(table.items()):
            raw = bytearray(ctypes.string_at(ctypes.addressof(v), ctypes.sizeof(v)))
            raw[reason_off : reason_off + 2] = wire.CONSTANTS["BURST_DRAIN"].to_bytes(2, "little")
            out.append(bytes(raw))
            try:
                del table[k]
            except KeyError:
                pass
        return out
