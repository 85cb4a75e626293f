"""A synchronous OpenAI-compatible server whose GPU work comes from known Python and
native code paths: the stand-in for the flame graph tests (tests/test_live_flame.py).

Single-threaded stdlib ``http.server``; POST /v1/completions decodes ``max_tokens``
steps; each step is, in Python (this file) and native code (``libttpaths.so``,
``flame_paths.c``, built without frame pointers) calling the stand-in ``libcuda.so.1``:

    decode_step
      embed        -> cuLaunchKernel(rmsnorm)                       (ctypes, direct)
      attention    -> tt_attention -> tt_launch -> cuLaunchKernel(attn_qkv, attn_score)
      mlp          -> tt_mlp -> tt_launch -> cuLaunchKernel(mlp_up, mlp_down)
        (attention and mlp once per layer: 1 layer, 3 for model "deep")
      final_norm   -> cuLaunchKernel(rmsnorm)                       (ctypes, direct)
      sample       -> tt_copy_out -> cuMemcpyDtoH_v2
      cuStreamSynchronize

Kernels are resolved at their first launch (as CUDA's lazy loading does), so a tracer
attached before the first request names them live. Ground truth: after each response
``TT_FLAME_TRUTH`` (JSON) is rewritten with, per response id, every GPU call in order as
[call kind, kernel or copy, Python function, native function]: what the tracer's flame
graph must show, call by call. Prints ``ready PORT`` when listening.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

KERNELS = ("attn_qkv", "attn_score", "mlp_up", "mlp_down", "rmsnorm")


class Model:
    """The decode step, through the paths in the module docstring."""

    def __init__(self, libcuda: str, libpaths: str) -> None:
        self.cuda = ctypes.CDLL(libcuda, mode=ctypes.RTLD_GLOBAL)
        self.paths = ctypes.CDLL(libpaths)
        self.cuda.cuInit(0)
        u = ctypes.c_uint
        self.cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u,
                                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.cuda.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        self.paths.tt_attention.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.paths.tt_mlp.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.paths.tt_copy_out.argtypes = [ctypes.c_void_p, ctypes.c_ulong]
        self.handles: dict[str, ctypes.c_void_p] = {}
        self.out = ctypes.create_string_buffer(256)
        self.calls: list[list[str]] = []  # this request's GPU calls, in order

    def kernel(self, name: str) -> ctypes.c_void_p:
        """A kernel's handle, resolved at its first launch."""
        h = self.handles.get(name)
        if h is None:
            h = ctypes.c_void_p()
            self.cuda.cuModuleGetFunction(ctypes.byref(h), None, name.encode())
            self.handles[name] = h
        return h

    def embed(self) -> None:
        self.calls.append(["kernel", "rmsnorm", "embed", ""])
        self.cuda.cuLaunchKernel(self.kernel("rmsnorm"), 1, 1, 1, 32, 1, 1, 0, None, None, None)

    def attention(self) -> None:
        self.calls.append(["kernel", "attn_qkv", "attention", "tt_attention"])
        self.calls.append(["kernel", "attn_score", "attention", "tt_attention"])
        self.paths.tt_attention(self.kernel("attn_qkv"), self.kernel("attn_score"))

    def mlp(self) -> None:
        self.calls.append(["kernel", "mlp_up", "mlp", "tt_mlp"])
        self.calls.append(["kernel", "mlp_down", "mlp", "tt_mlp"])
        self.paths.tt_mlp(self.kernel("mlp_up"), self.kernel("mlp_down"))

    def final_norm(self) -> None:
        self.calls.append(["kernel", "rmsnorm", "final_norm", ""])
        self.cuda.cuLaunchKernel(self.kernel("rmsnorm"), 1, 1, 1, 32, 1, 1, 0, None, None, None)

    def sample(self) -> None:
        self.calls.append(["memcpy", "DtoH", "sample", "tt_copy_out"])
        self.paths.tt_copy_out(self.out, 64)

    def decode_step(self, layers: int) -> None:
        self.embed()
        for _ in range(layers):
            self.attention()
            self.mlp()
        self.final_norm()
        self.sample()
        self.cuda.cuStreamSynchronize(None)

    def generate(self, steps: int, layers: int) -> list[list[str]]:
        self.calls = []
        for _ in range(steps):
            self.decode_step(layers)
        return self.calls


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "FlameServer"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def _send(self, status: int, doc: dict[str, Any]) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(200, {"status": "ok"} if self.path == "/health" else {"error": "not found"})

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        if self.path != "/v1/completions":
            self._send(404, {"error": "not found"})
            return
        steps = int(req.get("max_tokens") or 4)
        model = str(req.get("model", "tiny"))
        calls = self.server.model.generate(steps, 3 if model == "deep" else 1)
        rid = "cmpl-" + uuid.uuid4().hex
        self.server.record(rid, model, calls)
        self._send(200, {
            "id": rid, "object": "text_completion", "model": model,
            "choices": [{"index": 0, "text": " tok" * steps, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": steps, "total_tokens": 3 + steps},
        })


class FlameServer(HTTPServer):
    def __init__(self, port: int, model: Model, truth_path: str | None) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.model = model
        self.truth_path = truth_path
        self.truth: dict[str, Any] = {}

    def record(self, rid: str, model: str, calls: list[list[str]]) -> None:
        self.truth[rid] = {"model": model, "tid": threading.get_native_id(), "calls": calls,
                           "order": len(self.truth)}
        if self.truth_path:
            tmp = self.truth_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.truth, f)
            os.replace(tmp, self.truth_path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--libcuda", default=os.environ.get("TT_LIBCUDA", "libcuda.so.1"))
    ap.add_argument("--libpaths", required=True, help="libttpaths.so (samples/gpu/build.py)")
    args = ap.parse_args(argv)
    srv = FlameServer(args.port, Model(args.libcuda, args.libpaths),
                      os.environ.get("TT_FLAME_TRUTH"))
    print("ready", srv.server_address[1], flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    sys.exit(0)


if __name__ == "__main__":
    main()
