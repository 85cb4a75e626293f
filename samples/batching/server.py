"""An OpenAI-compatible server over a continuous-batching engine, in three layouts,
writing its own ground truth (docs/samples.md).

- ``thread``: the engine runs on its own thread in the API process; each step's tokens
  go to the uvicorn event loop with ``loop.call_soon_threadsafe``.
- ``process``: the engine is a child process (``samples.batching.worker``) connected to
  the API process by a unix stream socket at a filesystem path (listen/accept/connect),
  length-prefixed JSON messages both ways, as vLLM's API server and engine core.
- ``tp2``: as ``process``, but the engine is two tensor-parallel rank processes: rank 0
  schedules, sends each step's plan to rank 1 over a second unix stream socket, both
  run the step and one all-reduce (NCCL), rank 0 returns the tokens.

With ``--device cpu --libcuda PATH`` (and ``--libnccl PATH`` for tp2) each step also
makes the driver calls of a GPU step on the stand-in libraries; with ``--device cuda``
the forward runs on the GPU(s). Prints ``ready PORT`` once it serves.

    python -m samples.batching.server --port 8000 --layout thread --device cpu \\
        --libcuda build/gpu/libcuda.so.1 --truth truth.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Protocol

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from samples import tinygpt
from samples.batching import wire
from samples.batching.engine import Engine
from samples.batching.truth import TruthFile
from samples.openai_server import (DEFAULT_MAX_TOKENS, MODEL_NAME, _error, _prompt_of,
                                   add_info_routes)

ROOT = Path(__file__).resolve().parents[2]
BLOCK = tinygpt.GPTConfig().block


class EngineLost(RuntimeError):
    """The engine stopped answering (its process exited or its socket closed)."""


_LOST = object()


@dataclass
class Pending:
    """One request the API side is waiting on."""

    id: str
    arrival_ns: int
    prompt_tokens: int
    streamed: bool
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    admitted_ns: int | None = None
    first_token_ns: int | None = None


class Hub:
    """The API side of the engine: per-request token queues, fed on the event loop."""

    def __init__(self, truth: TruthFile) -> None:
        self.truth = truth
        self.pending: dict[str, Pending] = {}
        self.unknown_tokens = 0  # tokens for ids no request waits on (client gone)

    def open(self, rid: str, arrival_ns: int, prompt_tokens: int, streamed: bool) -> Pending:
        p = self.pending[rid] = Pending(rid, arrival_ns, prompt_tokens, streamed)
        return p

    def deliver(self, out: dict[str, Any]) -> None:
        """One step's output message from the engine."""
        now = time.monotonic_ns()
        for rid in out.get("admitted", []):
            if (p := self.pending.get(rid)) is not None:
                p.admitted_ns = out.get("t_start_ns")
        for rid, text in out.get("tokens", []):
            if (p := self.pending.get(rid)) is None:
                self.unknown_tokens += 1
                continue
            if p.first_token_ns is None:
                p.first_token_ns = now
            p.queue.put_nowait(text)
        for rid in out.get("finished", []):
            if (p := self.pending.get(rid)) is not None:
                p.queue.put_nowait(None)

    def lost(self) -> None:
        """The engine is gone: every waiting request ends with an error."""
        for p in self.pending.values():
            p.queue.put_nowait(_LOST)

    def finish(self, p: Pending, output_tokens: int) -> None:
        """The request's ground-truth line, once its response is complete."""
        self.pending.pop(p.id, None)
        self.truth.write({"type": "request", "id": p.id, "arrival_ns": p.arrival_ns,
                          "admitted_ns": p.admitted_ns, "first_token_ns": p.first_token_ns,
                          "end_ns": time.monotonic_ns(), "prompt_tokens": p.prompt_tokens,
                          "output_tokens": output_tokens, "streamed": p.streamed})

    def close(self, p: Pending) -> None:
        self.pending.pop(p.id, None)

    @staticmethod
    async def tokens(p: Pending) -> AsyncIterator[str]:
        while (tok := await p.queue.get()) is not None:
            if tok is _LOST:
                raise EngineLost("the engine is gone")
            yield tok


class Link(Protocol):
    """How the API side reaches the engine."""

    async def start(self, hub: Hub) -> None: ...
    async def submit(self, msg: dict[str, Any]) -> None: ...
    async def close(self) -> None: ...


class ThreadLink:
    """The engine on a thread of this process; steps handed to the loop thread-safely."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cond = threading.Condition()
        self.inbox: list[dict[str, Any]] = []
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)

    async def start(self, hub: Hub) -> None:
        self.hub = hub
        self.loop = asyncio.get_running_loop()
        self.thread.start()

    async def submit(self, msg: dict[str, Any]) -> None:
        if not self.thread.is_alive():
            raise EngineLost("the engine thread has stopped")
        with self.cond:
            self.inbox.append(msg)
            self.cond.notify()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            self.loop.call_soon_threadsafe(self.hub.lost)
            raise

    def _loop(self) -> None:
        sched = self.engine.scheduler
        while True:
            with self.cond:
                while not (self.inbox or sched.busy or self.stopping):
                    self.cond.wait()
                if self.stopping:
                    return
                msgs, self.inbox = self.inbox, []
            for m in msgs:
                self.engine.submit(m)
            if sched.busy:
                out = self.engine.step()
                self.loop.call_soon_threadsafe(self.hub.deliver, out)

    async def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        await asyncio.to_thread(self.thread.join, 30)


class SocketLink:
    """Engine rank processes, children of this one; rank 0 connects to our socket."""

    def __init__(self, commands: list[tuple[list[str], dict[str, str]]], tmpdir: str,
                 api_path: str, timeout: float = 300.0) -> None:
        listener = wire.listen(api_path)
        self.tmpdir = tmpdir
        self.procs = [subprocess.Popen(cmd, env=env, cwd=ROOT) for cmd, env in commands]
        listener.settimeout(0.5)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.conn, _ = listener.accept()
                break
            except TimeoutError:
                dead = [p.args for p in self.procs if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    self._stop_children()
                    raise RuntimeError(f"engine did not connect: {dead or 'timeout'}") from None
        listener.close()
        self.conn.setblocking(False)
        self.closing = False

    async def start(self, hub: Hub) -> None:
        self.hub = hub
        self.reader, self.writer = await asyncio.open_unix_connection(sock=self.conn)
        self.task = asyncio.create_task(self._read())

    async def submit(self, msg: dict[str, Any]) -> None:
        if self.task.done():
            raise EngineLost("the engine closed its socket")
        self.writer.write(wire.encode(msg))
        await self.writer.drain()

    async def _read(self) -> None:
        frames = wire.FrameReader()
        try:
            while data := await self.reader.read(1 << 16):
                for msg in frames.feed(data):
                    self.hub.deliver(msg)
        finally:
            self.hub.lost()
            if not self.closing:
                print("batching server: the engine closed its socket", file=sys.stderr,
                      flush=True)

    async def close(self) -> None:
        self.closing = True
        self.writer.close()  # rank 0 sees EOF, closes rank 1's socket, both exit
        await asyncio.to_thread(self._stop_children)
        self.task.cancel()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def _stop_children(self, grace: float = 20.0) -> None:
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()  # ranks ignore SIGTERM (they exit when their socket closes)
                p.wait()


def build_app(hub: Hub, link: Link) -> FastAPI:
    """The OpenAI routes of samples.openai_server, answered by the batching engine."""
    app = FastAPI(title="tokentrace continuous-batching sample")
    add_info_routes(app)

    async def complete(request: Request, chat: bool) -> Any:
        raw = await request.body()
        arrival_ns = time.monotonic_ns()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        model = body.get("model")
        if model != MODEL_NAME:
            return _error(404, f"The model `{model}` does not exist.", code="model_not_found")
        n = body.get("max_completion_tokens", body.get("max_tokens"))
        n = DEFAULT_MAX_TOKENS if n is None else n
        if not isinstance(n, int) or isinstance(n, bool) or n < 1 or n > 4096:
            return _error(400, "max_tokens must be an integer from 1 to 4096")
        temperature = body.get("temperature", 1.0)
        if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
            return _error(400, "temperature must be a number from 0 to 2")
        # The model's context is its block: longer prompts keep their last BLOCK tokens.
        ids = tinygpt.encode(_prompt_of(body, chat))[-BLOCK:]
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        stream = bool(body.get("stream"))
        p = hub.open(rid, arrival_ns, len(ids), stream)
        try:
            await link.submit({"id": rid, "prompt_ids": ids, "max_tokens": n,
                               "temperature": float(temperature)})
        except (OSError, EngineLost):
            hub.close(p)
            return _error(503, "the engine is not reachable", "server_error")
        usage = lambda k: {"prompt_tokens": len(ids), "completion_tokens": k,  # noqa: E731
                           "total_tokens": len(ids) + k}

        if not stream:
            try:
                text = [t async for t in hub.tokens(p)]
            except EngineLost:
                hub.close(p)
                return _error(503, "the engine exited", "server_error")
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": "".join(text)}
            else:
                choice["text"] = "".join(text)
            hub.finish(p, len(text))
            return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                    "created": created, "model": MODEL_NAME, "choices": [choice],
                    "usage": usage(len(text))}

        so = body.get("stream_options") or {}
        include_usage = isinstance(so, dict) and so.get("include_usage") is True
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            doc = {"id": rid, "object": obj, "created": created, "model": MODEL_NAME,
                   "choices": choices, **extra}
            return b"data: " + json.dumps(doc).encode() + b"\n\n"

        async def events() -> AsyncIterator[bytes]:
            count = 0
            try:
                if chat:  # like OpenAI and vLLM: a first chunk with the role and no text
                    yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "finish_reason": None}])
                async for tok in hub.tokens(p):
                    count += 1
                    yield chunk([{"index": 0, "delta": {"content": tok}, "finish_reason": None}
                                 if chat else {"index": 0, "text": tok, "finish_reason": None}])
                yield chunk([{"index": 0, "delta": {}, "finish_reason": "length"} if chat
                             else {"index": 0, "text": "", "finish_reason": "length"}])
                if include_usage:
                    yield chunk([], usage=usage(count))
                yield b"data: [DONE]\n\n"
            except BaseException:
                hub.close(p)
                raise
            hub.finish(p, count)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    return app


def _worker_commands(args: argparse.Namespace, api_path: str, peer_path: str
                     ) -> list[tuple[list[str], dict[str, str]]]:
    """The engine rank processes to start, each with its environment."""
    world = 2 if args.layout == "tp2" else 1
    dist_port = _free_port() if world > 1 and args.device == "cuda" else 0
    out = []
    for rank in range(world):
        cmd = [sys.executable, "-m", "samples.batching.worker", "--rank", str(rank),
               "--world", str(world), "--api-socket", api_path, "--peer-socket", peer_path,
               "--device", args.device, "--max-batch", str(args.max_batch),
               "--prefill-chunk", str(args.prefill_chunk), "--dist-port", str(dist_port)]
        for opt in ("truth", "libcuda", "libnccl"):
            if getattr(args, opt):
                cmd += [f"--{opt}", getattr(args, opt)]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        # The stand-ins write their call counts at exit: one file per rank process.
        for var in ("TT_STANDIN_COUNTS", "TT_STANDIN_NCCL_COUNTS"):
            if env.get(var):
                env[var] = f"{env[var]}.rank{rank}"
        out.append((cmd, env))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _thread_engine(args: argparse.Namespace, truth: TruthFile) -> Engine:
    from samples.batching.worker import make_engine
    return make_engine(args.device, args.max_batch, args.prefill_chunk, args.libcuda, None,
                       truth, rank=0, world=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port")
    p.add_argument("--layout", choices=("thread", "process", "tp2"), default="thread")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--truth", help="ground-truth JSON lines are appended here")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=32)
    p.add_argument("--libcuda", help="stand-in libcuda.so.1 the CPU engine calls")
    p.add_argument("--libnccl", help="stand-in libnccl.so.2 (tp2 on CPU)")
    args = p.parse_args(argv)
    if args.max_batch < 1 or args.prefill_chunk < 1:
        p.error("--max-batch and --prefill-chunk must be at least 1")
    if args.device == "cuda" and (args.libcuda or args.libnccl):
        p.error("--libcuda/--libnccl name stand-ins for --device cpu; cuda uses the real ones")
    if args.libnccl and args.layout != "tp2":
        p.error("--libnccl is for --layout tp2")
    if args.layout == "tp2" and bool(args.libcuda) != bool(args.libnccl):
        p.error("--layout tp2 on the stand-ins needs both --libcuda and --libnccl")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    torch.set_num_threads(1)
    truth = TruthFile(args.truth)
    link: Link
    if args.layout == "thread":
        link = ThreadLink(_thread_engine(args, truth))
    else:
        tmpdir = tempfile.mkdtemp(prefix="tt-batching-")
        api_path, peer_path = os.path.join(tmpdir, "api.sock"), os.path.join(tmpdir, "tp.sock")
        link = SocketLink(_worker_commands(args, api_path, peer_path), tmpdir, api_path)
    hub = Hub(truth)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    config = uvicorn.Config(build_app(hub, link), log_level="warning", http="httptools",
                            access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has shut down: with this
    # handler that ends in a normal exit, so the engine stops cleanly and the stand-in
    # libraries write their counts.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)

    async def serve() -> None:
        await link.start(hub)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            print("ready", sock.getsockname()[1], flush=True)
        try:
            await task
        finally:
            await link.close()

    asyncio.run(serve())
    truth.close()


if __name__ == "__main__":
    main()
