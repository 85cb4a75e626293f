"""GPU calls for HF ``transformers serve`` on a CPU: for the flame graph benchmark's CPU
run (``bench/flame.py --device cpu``) only; nothing here is part of tokentrace.

On a GPU host a Llama forward pass launches its kernels from inside the PyTorch ops
HF's modeling code calls (``F.linear`` in ``LlamaMLP.forward``, the attention function
``LlamaAttention.forward`` picks, ``torch.rsqrt`` in ``LlamaRMSNorm.forward``, ...),
and each engine step ends copying the sampled tokens to the host and synchronising.
On a CPU nothing reaches a CUDA driver. With ``TT_HF_LIBCUDA`` naming the stand-in
``libcuda.so.1`` (``samples/gpu/build.py``), this ``sitecustomize`` (on the server's
PYTHONPATH) wraps those ops so that each one also calls the stand-in's
``cuLaunchKernel`` with a kernel named after the op (resolved at its first launch, as
CUDA's lazy loading does), and ends every continuous-batching step that ran a batch
with ``cuMemcpyDtoH_v2`` and ``cuStreamSynchronize``. The launches then come from the
same Python frames as on a GPU, one wrapper frame (this file) above them.

With ``TT_HF_SHIM_WAIT=1`` no call is made until the process gets SIGUSR2: the
benchmark warms the server up, attaches, then signals, so that kernels are resolved
(and named by the tracer's probes) after the attach, as on a GPU server whose kernels
the tracer names from its libraries.
"""

from __future__ import annotations

import ctypes
import os
import threading

LIB = os.environ.get("TT_HF_LIBCUDA")
# op -> kernel name (what a CUDA build's kernel for it is called, roughly)
OPS = {"linear": "gemm_kernel", "scaled_dot_product_attention": "attention_kernel",
       "silu": "silu_kernel", "embedding": "embedding_kernel", "rsqrt": "rmsnorm_kernel",
       "softmax": "softmax_kernel"}
_state = threading.local()
_armed = threading.Event()


def _install() -> None:
    import torch
    import torch.nn.functional as F

    cuda = ctypes.CDLL(LIB, mode=ctypes.RTLD_GLOBAL)
    cuda.cuInit(0)
    u = ctypes.c_uint
    cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_void_p]
    cuda.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
    cuda.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_size_t]
    handles: dict[str, ctypes.c_void_p] = {}
    lock = threading.Lock()
    host = ctypes.create_string_buffer(4096)

    def launch(kernel: str) -> None:
        if not _armed.is_set():
            return
        h = handles.get(kernel)
        if h is None:
            with lock:
                h = handles.get(kernel)
                if h is None:
                    h = ctypes.c_void_p()
                    cuda.cuModuleGetFunction(ctypes.byref(h), None, kernel.encode())
                    handles[kernel] = h
        cuda.cuLaunchKernel(h, 1, 1, 1, 128, 1, 1, 0, None, None, None)
        _state.launches = getattr(_state, "launches", 0) + 1

    def wrap(owner: object, attr: str) -> None:
        real = getattr(owner, attr)
        kernel = OPS[attr]

        def op(*a, **kw):  # type: ignore[no-untyped-def]
            out = real(*a, **kw)
            launch(kernel)
            return out

        op.__name__ = op.__qualname__ = attr
        setattr(owner, attr, op)

    for name in ("linear", "scaled_dot_product_attention", "silu", "embedding", "softmax"):
        wrap(F, name)
    wrap(torch, "rsqrt")

    def step_end() -> None:
        """The sampled tokens to the host, and the wait for them."""
        cuda.cuMemcpyDtoH_v2(host, 0x7F0000001000, 64)
        cuda.cuStreamSynchronize(None)

    try:
        from transformers.generation.continuous_batching import continuous_api as api
    except ImportError:
        return
    body = api.ContinuousBatchingManager._generation_loop_body

    def loop_body(self, *a, **kw):  # type: ignore[no-untyped-def]
        _state.launches = 0
        go = body(self, *a, **kw)
        if _state.launches:
            step_end()
        return go

    api.ContinuousBatchingManager._generation_loop_body = loop_body


if LIB:
    if os.environ.get("TT_HF_SHIM_WAIT") == "1":
        import signal

        signal.signal(signal.SIGUSR2, lambda *_: _armed.set())
    else:
        _armed.set()
    _install()
