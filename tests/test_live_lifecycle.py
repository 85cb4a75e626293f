"""The agent's life cycle on a real traced process: killed with SIGKILL mid-run (no
chance to detach anything), it leaves the service answering as before and no BPF
program or link behind: the kernel drops what a dead process held."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from samples.gpu.build import build
from tracer.probes.uprobes import sys_bpf

pytestmark = pytest.mark.bpf

BPF_PROG_GET_NEXT_ID = 11
BPF_LINK_GET_NEXT_ID = 31


class _NextId(ctypes.Structure):
    _fields_ = [("start_id", ctypes.c_uint32), ("next_id", ctypes.c_uint32),
                ("open_flags", ctypes.c_uint32)]


def bpf_ids(cmd: int) -> set[int]:
    """Every BPF program (or link) id loaded on this machine now."""
    out, attr = set(), _NextId()
    while True:
        try:
            sys_bpf(cmd, attr)
        except OSError:
            return out  # ENOENT: no more
        out.add(attr.next_id)
        attr.start_id = attr.next_id


def complete(port: int, max_tokens: int) -> dict:
    body = json.dumps({"model": "tiny-gpt", "prompt": "hello", "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_sigkill_leaves_the_service_running_and_nothing_attached(tmp_path: Path):
    paths = build(tmp_path / "gpu")
    env = dict(os.environ, TT_LIBCUDA=str(paths["libcuda"]), TT_SYNC_KERNELS="3",
               TT_STANDIN_KERNEL_NS="20000")
    server = subprocess.Popen([sys.executable, "-m", "samples.gpu_sync_server"],
                              stdout=subprocess.PIPE, text=True, env=env)
    agent = None
    try:
        line = server.stdout.readline().split()
        assert line[:1] == ["ready"], line
        port = int(line[1])
        complete(port, 2)
        before = (bpf_ids(BPF_PROG_GET_NEXT_ID), bpf_ids(BPF_LINK_GET_NEXT_ID))
        agent = subprocess.Popen([sys.executable, "-m", "tracer", "run", "--pid",
                                  str(server.pid), "--quiet", "--jsonl",
                                  str(tmp_path / "spans.jsonl")],
                                 stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            err = agent.stderr.readline()
            assert err, "the agent exited before attaching"
            if "attached" in err:
                break
        progs = bpf_ids(BPF_PROG_GET_NEXT_ID)
        assert len(progs - before[0]) >= 10  # socket tracepoints and the GPU uprobes
        answers = [complete(port, n) for n in (1, 2, 3)]
        agent.kill()  # SIGKILL: no handler runs, nothing is detached by the agent
        agent.wait(10)
        # the service goes on answering, exactly as before
        after = [complete(port, n) for n in (1, 2, 3)]
        assert server.poll() is None
        assert [len(a["choices"][0]["text"]) > 0 for a in answers + after] == [True] * 6
        # and the kernel has dropped every program and link the agent held
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = (bpf_ids(BPF_PROG_GET_NEXT_ID) - before[0],
                    bpf_ids(BPF_LINK_GET_NEXT_ID) - before[1])
            if not left[0] and not left[1]:
                break
            time.sleep(0.2)
        assert left == (set(), set()), left
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
        server.terminate()
        server.wait(10)
