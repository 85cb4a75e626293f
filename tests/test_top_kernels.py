"""Kernel names a person can read, and each request's top kernels by its share."""

from __future__ import annotations

from collections import Counter

import pytest

from tracer.correlate.attribution import GpuAttribution
from tracer.correlate.kernelnames import demangle, readable
from tracer.correlate.records import RequestRecord
from tracer.events.gpu import KernelBurst


@pytest.mark.parametrize("mangled, short", [
    ("_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEESt5arrayIPcLm1EEEEviT0_T1_",
     "vectorized_elementwise_kernel<FillFunctor>"),
    ("_ZN2at6native18elementwise_kernelILi128ELi2EZNS0_22gpu_kernel_impl_nocastIZZZNS0_23direct_"
     "copy_kernel_cudaERNS_18TensorIteratorBaseEENKUlvE1_clEvENKUlvE8_clEvEUlN3c108BFloat16EE_EEv"
     "S4_RKT_EUliE_EEviT1_", "elementwise_kernel<gpu_kernel_impl_nocast>"),
    ("_ZN2at6native13reduce_kernelILi512ELi1ENS0_8ReduceOpIfNS0_14func_wrapper_tIfZNS0_11sum_"
     "functorIfffEclERNS_14TensorIteratorEEUlffE_EEjfLi4ELi4EEEEEvT1_", "reduce_kernel<ReduceOp>"),
    ("_Z10sample_fwdPKfPii", "sample_fwd"),
    ("triton_poi_fused_add_0", "triton_poi_fused_add_0"),  # not C++: as it is
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_coopB_NNN", "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_coopB_NNN"),
    ("_Zbroken", "_Zbroken"),  # not a valid mangling: never guessed
    # cut short where it was read: the kernel's own identifier from the mangled prefix
    ("_Z16gemmSN_TN_kernelIfLi128ELi16ELi2ELi4ELi8ELi9ELb0E30cublasGemvTensorStridedBat",
     "gemmSN_TN_kernel"),
    ("_ZN2at6native13reduce_kernelILi512ELi1ENS0_8ReduceOpIfNS0_14func", "reduce_kernel"),
])
def test_readable_names(mangled, short):
    assert readable(mangled) == short


def test_demangle_keeps_the_whole_name():
    assert demangle("_Z10sample_fwdPKfPii") == "sample_fwd(float const*, int*, int)"


def burst(tid: int, first: int, last: int, kernels: dict[int, int]) -> KernelBurst:
    return KernelBurst(pid=1, tid=tid, reason="sync", sync_api=0, first_ts=first, last_ts=last,
                       launches=sum(kernels.values()), graph_launches=0,
                       copy_bytes={"h2d": 0, "d2h": 4, "d2d": 0, "other": 0},
                       copy_calls={"d2h": 1}, memset_bytes=0, memset_calls=0, sync_calls=1,
                       sync_wait_ns=0, query_polls=0, handle_counts=kernels)


def test_each_request_names_its_top_kernels_by_its_share():
    names = {0xA: "_Z10sample_fwdPKfPii", 0xB: "triton_poi_fused_add_0"}
    out: list[RequestRecord] = []
    alone = RequestRecord(pid=1, fd=5, conn_id=5, exchange=0, role="server", tids=[7],
                          start_ns=0, end_ns=100)
    shared = RequestRecord(pid=1, fd=6, conn_id=6, exchange=0, role="server", tids=[8],
                           start_ns=0, end_ns=100)
    in_flight = [alone, shared]
    a = GpuAttribution(out.append, lambda pid: list(in_flight), Counter(), hold_ns=10,
                       kernel_name=lambda pid, h: readable(names.get(h, f"unknown@{h:#x}")))
    # a's own thread: whole; the engine thread: shared by the two (by time, no tokens)
    a.burst(burst(7, 10, 20, {0xA: 4}))
    a.burst(burst(99, 30, 40, {0xA: 2, 0xB: 6, 0xC: 1}))
    for r in (alone, shared):
        in_flight.remove(r)
        a.finished(r)
    a.close()
    assert alone.gpu["gpu.top_kernels"] == ["sample_fwd: 5.0", "triton_poi_fused_add_0: 3.0",
                                            "unknown@0xc: 0.5"]
    assert shared.gpu["gpu.top_kernels"] == ["triton_poi_fused_add_0: 3.0", "sample_fwd: 1.0",
                                             "unknown@0xc: 0.5"]
