"""A synchronous OpenAI-compatible server that really calls libcuda.so.1: the layout
where a request's GPU work runs on the thread that reads and answers it.

Single-threaded stdlib ``http.server``; POST /v1/completions runs one decode step per
output token (``max_tokens``, default 8), each launching ``TT_SYNC_KERNELS`` (default
4) kernels with ``cuLaunchKernel`` and waiting with ``cuStreamSynchronize``. The driver
is loaded with ctypes from ``TT_LIBCUDA`` (default ``libcuda.so.1``), e.g. the stand-in
built by ``samples/gpu/build.py``.

Ground truth: after each response, ``TT_SYNC_TRUTH`` (a JSON file) is rewritten with
``{response id: {"launches": n, "steps": n}}``. Prints ``ready PORT`` when listening.

    TT_LIBCUDA=build/gpu/libcuda.so.1 python -m samples.gpu_sync_server --port 8000
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

KERNEL_NAME = b"_Z13tt_sync_decodePfS_i"


class Gpu:
    """The few driver calls a decode step makes."""

    def __init__(self, path: str, kernels: int) -> None:
        self.cuda = ctypes.CDLL(path)
        self.kernels = kernels
        self.cuda.cuInit(0)
        dev = ctypes.c_int()
        self.cuda.cuDeviceGet(ctypes.byref(dev), 0)
        self.ctx = ctypes.c_void_p()
        self.cuda.cuCtxCreate_v2(ctypes.byref(self.ctx), 0, dev)
        self.fn = ctypes.c_void_p()
        self.cuda.cuModuleGetFunction(ctypes.byref(self.fn), None, KERNEL_NAME)
        u = ctypes.c_uint
        self.cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u,
                                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.cuda.cuStreamSynchronize.argtypes = [ctypes.c_void_p]

    def step(self) -> int:
        """One decode step: launch the kernels, wait for them; returns launches made."""
        for _ in range(self.kernels):
            rc = self.cuda.cuLaunchKernel(self.fn, 1, 1, 1, 32, 1, 1, 0, None, None, None)
            if rc != 0:
                raise RuntimeError(f"cuLaunchKernel returned {rc}")
        self.cuda.cuStreamSynchronize(None)
        return self.kernels


class Handler(BaseHTTPRequestHandler):
    """POST /v1/completions (non-streamed) and GET /health."""

    protocol_version = "HTTP/1.1"
    server: "SyncServer"

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
        if self.path == "/health":
            self._send(200, {"status": "ok"})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        if self.path != "/v1/completions":
            self._send(404, {"error": "not found"})
            return
        steps = int(req.get("max_tokens") or 8)
        launches = sum(self.server.gpu.step() for _ in range(steps))
        rid = "cmpl-" + uuid.uuid4().hex
        self.server.record(rid, launches, steps)
        prompt = str(req.get("prompt", ""))
        self._send(200, {
            "id": rid, "object": "text_completion", "model": req.get("model", "tiny-gpt"),
            "choices": [{"index": 0, "text": " tok" * steps, "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": steps,
                      "total_tokens": len(prompt.split()) + steps},
        })


class SyncServer(HTTPServer):
    """One thread: accept, read, decode on the GPU, answer, then the next request."""

    def __init__(self, port: int, gpu: Gpu, truth_path: str | None) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.gpu = gpu
        self.truth_path = truth_path
        self.truth: dict[str, dict[str, int]] = {}

    def record(self, rid: str, launches: int, steps: int) -> None:
        """Ground truth for one response, written out at once."""
        self.truth[rid] = {"launches": launches, "steps": steps}
        if self.truth_path:
            tmp = self.truth_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.truth, f)
            os.replace(tmp, self.truth_path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    gpu = Gpu(os.environ.get("TT_LIBCUDA", "libcuda.so.1"),
              int(os.environ.get("TT_SYNC_KERNELS", "4")))
    srv = SyncServer(args.port, gpu, os.environ.get("TT_SYNC_TRUTH"))
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
