"""A real KServe v2 / Triton-style gRPC inference server for tracing: grpcio serving
``samples.tinygpt`` (on CPU or CUDA) through ``inference.GRPCInferenceService``.

- ``ModelInfer`` (unary): input ``text_input`` (BYTES [1]) and optional ``max_tokens``
  (INT32 [1]); output ``text_output`` (BYTES [1], the whole completion).
- ``ModelStreamInfer`` (bidi, like Triton's decoupled LLM backends): every request on
  the stream is answered with one response per generated token (``text_output``
  holding that token), the last one marked with the ``triton_final_response``
  parameter (or an extra empty final response when the request sets
  ``triton_enable_empty_final_response``). Errors travel in ``error_message``.
- ``num_input_tokens`` / ``num_output_tokens`` (UINT32 [1]) are returned only when the
  request asks for them by name, as vLLM's Triton backend does.
- An unknown model: ``NOT_FOUND`` (a trailers-only response) for ModelInfer.

Outputs go in ``raw_output_contents``, as Triton sends them.

    python -m samples.kserve_grpc_server --port 8001 [--token-rate 50] [--device cuda]
                                         [--compression gzip|deflate]
"""

from __future__ import annotations

import argparse
import signal
import struct
import threading
from concurrent import futures
from typing import Any, Iterator

import grpc
import torch

from protocols.proto import grpc_predict_v2_pb2 as pb
from protocols.proto import grpc_predict_v2_pb2_grpc as pbg
from samples import tinygpt
from samples.openai_server import Engine

MODEL_NAME = "tiny-gpt"
MODEL_VERSION = "1"
DEFAULT_MAX_TOKENS = 16


def bytes_tensor(values: list[bytes]) -> bytes:
    """BYTES tensor contents in Triton's raw form: 4-byte little-endian length, bytes."""
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def _input(req: Any, name: str) -> tuple[str, bytes | None]:
    for i, t in enumerate(req.inputs):
        if t.name == name:
            if i < len(req.raw_input_contents):
                return t.datatype, req.raw_input_contents[i]
            c = t.contents
            if c.bytes_contents:
                return t.datatype, bytes_tensor(list(c.bytes_contents))
            ints = list(c.int_contents) or list(c.int64_contents) or list(c.uint_contents)
            return t.datatype, struct.pack("<q", ints[0]) if ints else None
    return "", None


def _prompt_and_max_tokens(req: Any) -> tuple[str, int]:
    dt, raw = _input(req, "text_input")
    prompt = ""
    if raw is not None and len(raw) >= 4:
        (n,) = struct.unpack_from("<I", raw)
        prompt = raw[4:4 + n].decode("utf-8", "replace")
    dt, raw = _input(req, "max_tokens")
    fmt = {"INT32": "<i", "INT64": "<q", "UINT32": "<I", "UINT64": "<Q"}.get(dt, "<q")
    n = struct.unpack_from(fmt, raw)[0] if raw and len(raw) >= struct.calcsize(fmt) else 0
    return prompt, int(n) if n > 0 else DEFAULT_MAX_TOKENS


def _wanted(req: Any, name: str) -> bool:
    return any(o.name == name for o in req.outputs)


def _response(req: Any, text: str, prompt_tokens: int, out_tokens: int,
              final: bool | None = None) -> Any:
    r = pb.ModelInferResponse(model_name=MODEL_NAME, model_version=MODEL_VERSION, id=req.id)
    if text:
        r.outputs.add(name="text_output", datatype="BYTES", shape=[1])
        r.raw_output_contents.append(bytes_tensor([text.encode()]))
    for name, value in (("num_input_tokens", prompt_tokens), ("num_output_tokens", out_tokens)):
        if _wanted(req, name):
            r.outputs.add(name=name, datatype="UINT32", shape=[1])
            r.raw_output_contents.append(struct.pack("<I", value))
    if final is not None:
        r.parameters["triton_final_response"].bool_param = final
    return r


class InferenceService(pbg.GRPCInferenceServiceServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=True)

    def ModelReady(self, request: Any, context: Any) -> Any:
        return pb.ModelReadyResponse(ready=request.name == MODEL_NAME)

    def ServerMetadata(self, request: Any, context: Any) -> Any:
        return pb.ServerMetadataResponse(name="tokentrace-sample", version="0.1")

    def ModelMetadata(self, request: Any, context: Any) -> Any:
        if request.name != MODEL_NAME:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model: {request.name}")
        return pb.ModelMetadataResponse(name=MODEL_NAME, versions=[MODEL_VERSION],
                                        platform="pytorch")

    def ModelInfer(self, request: Any, context: Any) -> Any:
        if request.model_name != MODEL_NAME:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"Request for unknown model: '{request.model_name}' is not found")
        prompt, n = _prompt_and_max_tokens(request)
        text = "".join(self.engine.generate(prompt, n, 1.0))
        return _response(request, text, tinygpt.count_tokens(prompt), n)

    def ModelStreamInfer(self, request_iterator: Iterator[Any], context: Any
                         ) -> Iterator[Any]:
        for request in request_iterator:
            if request.model_name != MODEL_NAME:
                yield pb.ModelStreamInferResponse(
                    error_message=f"Request for unknown model: '{request.model_name}'")
                continue
            prompt, n = _prompt_and_max_tokens(request)
            ptoks = tinygpt.count_tokens(prompt)
            p = request.parameters.get("triton_enable_empty_final_response")
            empty_final = p is not None and p.bool_param
            for i, tok in enumerate(self.engine.generate(prompt, n, 1.0)):
                last = i == n - 1 and not empty_final
                yield pb.ModelStreamInferResponse(
                    infer_response=_response(request, tok, ptoks, 1, final=last))
            if empty_final:
                r = pb.ModelInferResponse(model_name=MODEL_NAME, model_version=MODEL_VERSION,
                                          id=request.id)
                r.parameters["triton_final_response"].bool_param = True
                yield pb.ModelStreamInferResponse(infer_response=r)


COMPRESSION = {"none": grpc.Compression.NoCompression, "gzip": grpc.Compression.Gzip,
               "deflate": grpc.Compression.Deflate}


def serve(port: int, engine: Engine, host: str = "127.0.0.1", workers: int = 96,
          compression: str = "none", tls: tuple[str, str] | None = None) -> Any:
    """Start the server; ``compression`` (a key of ``COMPRESSION``) compresses every
    response message (gRPC message compression, ``grpc-encoding``); ``tls``
    (certificate, key PEM files): serve over TLS (grpcio's own BoringSSL)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                         options=[("grpc.max_concurrent_streams", 1000)],
                         compression=COMPRESSION[compression])
    pbg.add_GRPCInferenceServiceServicer_to_server(InferenceService(engine), server)
    if tls is not None:
        with open(tls[0], "rb") as c, open(tls[1], "rb") as k:
            creds = grpc.ssl_server_credentials([(k.read(), c.read())])
        server.add_secure_port(f"{host}:{port}", creds)
    else:
        server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--token-rate", type=float, default=0.0,
                   help="max tokens/s per request (0: as fast as the model goes)")
    p.add_argument("--workers", type=int, default=96, help="concurrent calls served")
    p.add_argument("--compression", choices=sorted(COMPRESSION), default="none",
                   help="compress response messages with this grpc-encoding")
    p.add_argument("--ssl-certfile", help="serve over TLS with this certificate (PEM)")
    p.add_argument("--ssl-keyfile", help="...and this key (PEM)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tls = (args.ssl_certfile, args.ssl_keyfile) if args.ssl_certfile else None
    server = serve(args.port, Engine(args.device, args.token_rate), args.host, args.workers,
                   args.compression, tls)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    server.stop(grace=1).wait()


if __name__ == "__main__":
    main()
