"""Start HF ``transformers serve`` on a tiny Llama with the ground-truth recorder.

``HfServer`` runs ``transformers serve MODEL [--continuous-batching]`` in its own
process group with ``samples/hf/truth`` on its PYTHONPATH (the recorder's
``sitecustomize``) and ``TT_HF_TRUTH`` naming the truth file, waits until it answers,
and warms it up (the engine is built on the first request, kernels load on the first
prefill and decode) before anyone traces it. ``flush_truth`` asks the recorder for the
profiler's per-step kernels and waits for them. With ``tls`` (certificate, key) it
serves HTTPS through ``samples/hf/tls_serve.py`` (uvicorn given the certificate).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

TRUTH_DIR = Path(__file__).resolve().parent / "truth"
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HfServer:
    """One ``transformers serve`` process and its truth file."""

    def __init__(self, model: Path, truth: Path, log: Path, continuous: bool = True,
                 device: str = "cpu", extra: list[str] | None = None,
                 tls: tuple[Path, Path] | None = None) -> None:
        self.model, self.truth, self.log = model, truth, log
        self.port = free_port()
        self.tls = tls
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        env = dict(os.environ, TT_HF_TRUTH=str(truth), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(TRUTH_DIR), str(ROOT),
                                                            os.environ.get("PYTHONPATH")])))
        entry = ["transformers.cli.transformers", "serve"]
        if tls is not None:
            env.update(TT_SSL_CERTFILE=str(tls[0]), TT_SSL_KEYFILE=str(tls[1]))
            entry = ["samples.hf.tls_serve"]
        cmd = [sys.executable, "-m", *entry, str(model),
               "--device", device, "--port", str(self.port), "--host", "127.0.0.1",
               *(["--continuous-batching"] if continuous else []), *(extra or [])]
        self._log: IO[str] = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, text=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2,
                                            context=self._ssl()) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"transformers serve did not start:\n{self.log.read_text()[-3000:]}")

    def chat(self, content: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
        """One plain HTTP request (warm-up and the recorder's final poke)."""
        body = json.dumps({"model": str(self.model), "max_tokens": max_tokens, "stream": stream,
                           "messages": [{"role": "user", "content": content}]}).encode()
        req = urllib.request.Request(self.url + "/v1/chat/completions", body,
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120, context=self._ssl()) as r:
            data = r.read()
        return {} if stream else json.loads(data)

    def _ssl(self) -> Any:
        """The client context that trusts the server's certificate (None: plain HTTP)."""
        if self.tls is None:
            return None
        import ssl
        return ssl.create_default_context(cafile=str(self.tls[0]))

    def warm_up(self) -> None:
        """Build the engine and load every kernel a short and a long prompt need."""
        for words, stream in ((3, False), (200, True), (40, False), (300, True)):
            self.chat(" ".join(["the model reads"] * words), 8, stream)

    def flush_truth(self, timeout: float = 120.0) -> None:
        """SIGUSR1: the recorder stops its profiler at its next loop and writes the
        per-step kernels; a sequential server loops only on a request, so one is sent."""
        os.kill(self.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        poked = False
        while time.monotonic() < deadline:
            if self.truth.exists() and b'"type":"flushed"' in self.truth.read_bytes():
                return
            if not poked and time.monotonic() > deadline - timeout + 1.0:
                poked = True
                try:
                    self.chat("poke", 1)
                except OSError:
                    pass
            time.sleep(0.2)
        raise RuntimeError("the truth recorder did not flush")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        self._log.close()
