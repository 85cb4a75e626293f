"""Start a sample server as a real separate process and wait until it answers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class SampleServer:
    """``python -m samples.<module> --port PORT ...`` in its own process group."""

    def __init__(self, module: str = "samples.openai_server", port: int = 8765,
                 args: list[str] | None = None, health: str = "/health",
                 log: str | Path | None = None, env: dict[str, str] | None = None,
                 tls: tuple[Path, Path] | None = None) -> None:
        """``tls``: (certificate, key) to serve HTTPS with (the module takes
        ``--ssl-certfile``/``--ssl-keyfile``)."""
        self.module = module
        self.tls = tls
        self.port = port
        self.args = list(args or [])
        if tls is not None:
            self.args += ["--ssl-certfile", str(tls[0]), "--ssl-keyfile", str(tls[1])]
        self.health = health
        self.log = log
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "SampleServer":
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.update(self.env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, "--port", str(self.port), *self.args],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.module} exited with {self.proc.returncode}"
                                   + (f"; see {self.log}" if self.log else ""))
            if self.health and self._healthy():
                return self
            if not self.health:
                time.sleep(0.5)
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.module} did not answer on port {self.port} in {timeout}s")

    def _healthy(self) -> bool:
        ctx = None
        if self.tls is not None:
            import ssl
            ctx = ssl.create_default_context(cafile=str(self.tls[0]))
        try:
            with urllib.request.urlopen(self.base_url + self.health, timeout=1,
                                        context=ctx) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> "SampleServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
