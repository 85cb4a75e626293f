"""A real OpenAI-compatible inference server for tracing: FastAPI on uvicorn (the
stack of vLLM's API server) serving ``samples.tinygpt`` on CPU or CUDA.

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as SSE, or not;
``stream_options.include_usage`` adds the final usage chunk), GET /v1/models, GET
/health. Each request runs its own decode loop in a worker thread; ``--token-rate``
caps tokens per second per request, so TTFT and inter-token gaps are controllable.

    python -m samples.openai_server --port 8000 [--token-rate 50] [--device cuda]
        [--ssl-certfile cert.pem --ssl-keyfile key.pem]   # HTTPS (samples/tlscert.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from typing import Any, AsyncIterator, Iterator

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from samples import tinygpt

MODEL_NAME = "tiny-gpt"
DEFAULT_MAX_TOKENS = 16


class Engine:
    """Runs decode loops; one lock so concurrent requests take turns on the model."""

    def __init__(self, device: str, token_rate: float) -> None:
        self.model, self.device = tinygpt.load_model(device)
        self.token_rate = token_rate
        self.lock = threading.Lock()

    def generate(self, prompt: str, max_tokens: int, temperature: float,
                 seed: int | None = None) -> Iterator[str]:
        ids = tinygpt.encode(prompt)[-self.model.cfg.block:]
        ctx = torch.tensor([ids], device=self.device)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed if seed is not None else hash(prompt) & 0xFFFFFFFF)
        start = time.monotonic()
        for i in range(max_tokens):
            with self.lock:
                nxt = self.model.step(ctx, temperature, gen)
                token = int(nxt[0])  # .item(): waits for the GPU, like a real server
            ctx = torch.cat([ctx, nxt.view(1, 1)], dim=1)[:, -self.model.cfg.block:]
            if self.token_rate > 0:
                delay = start + (i + 1) / self.token_rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            yield tinygpt.decode_token(token)


def _error(status: int, message: str, etype: str = "invalid_request_error",
           code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": etype, "code": code}})


def _prompt_of(body: dict[str, Any], chat: bool) -> str:
    if chat:
        parts = []
        for m in body.get("messages") or []:
            c = m.get("content", "") if isinstance(m, dict) else ""
            if isinstance(c, list):
                c = " ".join(p.get("text", "") for p in c if isinstance(p, dict))
            parts.append(str(c))
        return "\n".join(parts)
    p = body.get("prompt", "")
    return "\n".join(map(str, p)) if isinstance(p, list) else str(p)


async def _tokens(engine: Engine, prompt: str, n: int, temperature: float,
                  seed: int | None) -> AsyncIterator[str]:
    """The decode loop in a thread, tokens handed to the event loop as they come."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[str | None] = asyncio.Queue()

    def work() -> None:
        try:
            for tok in engine.generate(prompt, n, temperature, seed):
                loop.call_soon_threadsafe(q.put_nowait, tok)
        finally:
            loop.call_soon_threadsafe(q.put_nowait, None)

    threading.Thread(target=work, daemon=True).start()
    while (tok := await q.get()) is not None:
        yield tok


def add_info_routes(app: FastAPI) -> None:
    """GET /health and GET /v1/models, the same in every sample server."""

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model",
                                            "owned_by": "tokentrace"}]}


def build_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="tokentrace sample OpenAI server")
    add_info_routes(app)

    async def complete(request: Request, chat: bool) -> Any:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        model = body.get("model")
        if model != MODEL_NAME:
            return _error(404, f"The model `{model}` does not exist.", code="model_not_found")
        n = body.get("max_completion_tokens", body.get("max_tokens")) or DEFAULT_MAX_TOKENS
        if not isinstance(n, int) or n < 1 or n > 4096:
            return _error(400, "max_tokens must be an integer from 1 to 4096")
        temperature = float(body.get("temperature", 1.0))
        seed = body.get("seed") if isinstance(body.get("seed"), int) else None
        prompt = _prompt_of(body, chat)
        prompt_tokens = tinygpt.count_tokens(prompt)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        usage = lambda k: {"prompt_tokens": prompt_tokens, "completion_tokens": k,  # noqa: E731
                           "total_tokens": prompt_tokens + k}

        if not body.get("stream"):
            text = "".join([t async for t in _tokens(engine, prompt, n, temperature, seed)])
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                    "created": created, "model": MODEL_NAME, "choices": [choice],
                    "usage": usage(n)}

        so = body.get("stream_options") or {}
        include_usage = isinstance(so, dict) and so.get("include_usage") is True
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            doc = {"id": rid, "object": obj, "created": created, "model": MODEL_NAME,
                   "choices": choices, **extra}
            return b"data: " + json.dumps(doc).encode() + b"\n\n"

        async def stream() -> AsyncIterator[bytes]:
            if chat:  # like OpenAI and vLLM: a first chunk with the role and no text
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "finish_reason": None}])
            count = 0
            async for tok in _tokens(engine, prompt, n, temperature, seed):
                count += 1
                c = ({"index": 0, "delta": {"content": tok}, "finish_reason": None} if chat
                     else {"index": 0, "text": tok, "finish_reason": None})
                yield chunk([c])
            last = ({"index": 0, "delta": {}, "finish_reason": "length"} if chat
                    else {"index": 0, "text": "", "finish_reason": "length"})
            yield chunk([last])
            if include_usage:
                yield chunk([], usage=usage(count))
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--token-rate", type=float, default=0.0,
                   help="max tokens/s per request (0: as fast as the model goes)")
    p.add_argument("--loop", default="auto", help="uvicorn event loop: auto, asyncio, uvloop")
    p.add_argument("--keep-alive", type=float, default=30.0,
                   help="seconds an idle keep-alive connection stays open (uvicorn's "
                        "default, 5 s, is about what compiling the probes takes, and a "
                        "tracer attaching to open connections needs them to outlive it)")
    p.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--ssl-keyfile", help="...and this key (PEM)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    engine = Engine(args.device, args.token_rate)
    uvicorn.run(build_app(engine), host=args.host, port=args.port, log_level="warning",
                http="httptools", loop=args.loop, access_log=False,
                timeout_keep_alive=args.keep_alive, ssl_certfile=args.ssl_certfile,
                ssl_keyfile=args.ssl_keyfile)


if __name__ == "__main__":
    main()
