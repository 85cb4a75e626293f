"""Ground truth recorded inside HF ``transformers serve``: for the test harness only.

Python imports ``sitecustomize`` at start-up from the first ``sys.path`` entry that has
one, so the harness puts this folder on the server's PYTHONPATH and names a truth file
in ``TT_HF_TRUTH``. Nothing here is part of tokentrace: it is how a benchmark learns
what really happened inside a server it did not write, to score the tracer against.

Continuous batching (``--continuous-batching``): every engine step (one call of
``ContinuousBatchingManager._generation_loop_body`` that ran a batch) writes a line

    {"type": "step", "step": n, "pid", "tid", "t_start_ns", "t_end_ns", "gpu_ns",
     "members": [{"id", "phase": "prefill"|"decode", "tokens": query tokens, "emits"}]}

with CLOCK_MONOTONIC stamps (the clock the probes use) and ``gpu_ns`` from CUDA events
on the engine's compute stream. Sequential serving (no flag): one line per
``generate`` call, its request as the only member, phase "whole". Each request's arrival
(``add_request``, or the call's start) and first token go in a ``request`` line.

On a CUDA device a ``torch.profiler`` session runs on the engine thread with each step
inside ``record_function("tt_step:N")``; on SIGUSR1 the engine thread stops it at its
next loop and writes ``{"type": "step_kernels", "step", "launches", "kernels",
"kernel_ns"}`` per step (launch API calls and device kernels that fall in the step's
window, and the kernels' summed device time), then ``{"type": "flushed"}``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import deque
from typing import Any

PATH = os.environ.get("TT_HF_TRUTH")
LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel",
               "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel",
               "cudaGraphLaunch", "cuGraphLaunch")


class Truth:
    """Append-only JSON lines, one ``os.write`` each (O_APPEND keeps them whole)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.lock = threading.Lock()

    def write(self, doc: dict[str, Any]) -> None:
        line = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
        with self.lock:
            os.write(self.fd, line)


class Recorder:
    """Step lines as they happen; the profiler's per-step kernels on flush."""

    def __init__(self, truth: Truth) -> None:
        self.truth = truth
        self.flush_asked = threading.Event()
        self.flush_lock = threading.Lock()
        self.prof: Any = None
        self.flushed = False  # the profiler runs once, from the first step to the flush
        self.first_token_seen: set[str] = set()
        self.arrivals: dict[str, int] = {}
        self.pending_members: list[dict[str, Any]] | None = None
        self.step = 0
        self.pending: dict[str, Any] | None = None
        self.pending_events: Any = None

    # -- profiler --------------------------------------------------------------------
    def start_profiler(self) -> None:
        import torch
        if self.prof is not None or self.flushed or not torch.cuda.is_available():
            return
        from torch.profiler import ProfilerActivity, profile
        self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self.prof.__enter__()

    def maybe_flush(self) -> None:
        """On the engine thread: stop the profiler and write per-step kernels."""
        with self.flush_lock:
            if not self.flush_asked.is_set():
                return
            self.flush_asked.clear()
            self.flushed = True
        self.write_pending()
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.__exit__(None, None, None)
            for doc in step_kernels(prof):
                self.truth.write(doc)
        self.truth.write({"type": "flushed", "t_ns": time.monotonic_ns()})

    def window(self, n: int) -> Any:
        from contextlib import nullcontext
        if self.prof is None:
            return nullcontext()
        from torch.profiler import record_function
        return record_function(f"tt_step:{n}")

    # -- lines -------------------------------------------------------------------------
    def arrived(self, rid: str) -> None:
        self.arrivals.setdefault(rid, time.monotonic_ns())

    def step_line(self, t0: int, t1: int, events: Any, members: list[dict[str, Any]]) -> None:
        """Write the previous step's line (its CUDA events have completed by now: a
        synchronising call here would add a sync the probes see) and keep this one."""
        self.write_pending()
        self.pending = {"type": "step", "step": self.step, "pid": os.getpid(),
                        "tid": threading.get_native_id(), "t_start_ns": t0, "t_end_ns": t1,
                        "gpu_ns": None, "members": members}
        self.pending_events = events
    def write_pending(self) -> None:
        doc, ev = self.pending, self.pending_events
        if doc is None:
            return
        self.pending = self.pending_events = None
        if ev is not None:
            try:
                doc["gpu_ns"] = int(ev[0].elapsed_time(ev[1]) * 1e6)
            except RuntimeError:  # not complete (cudaErrorNotReady): leave it unknown
                pass
        self.truth.write(doc)
        for m in doc["members"]:
            if m.get("emits") and m["id"] not in self.first_token_seen:
                self.first_token_seen.add(m["id"])
                self.truth.write({"type": "request", "id": m["id"],
                                  "arrival_ns": self.arrivals.pop(m["id"], None),
                                  "first_token_ns": doc["t_end_ns"]})


def step_kernels(prof: Any) -> list[dict[str, Any]]:
    """Per profiled step: launch API calls and device kernels that fall in its window.

    Windows are the ``tt_step:N`` annotations; a launch belongs to the window that
    contains its start, and a kernel to the window of the launch that enqueued it
    (CUPTI's correlation id)."""
    from bisect import bisect_right
    events = prof.profiler.kineto_results.events()
    wins: list[tuple[int, int, int]] = []
    for e in events:
        name = e.name()
        if name.startswith("tt_step:"):
            wins.append((e.start_ns(), e.end_ns(), int(name.split(":", 1)[1])))
    wins.sort()
    starts = [w[0] for w in wins]

    def window_of(ts: int) -> int | None:
        i = bisect_right(starts, ts) - 1
        return wins[i][2] if i >= 0 and ts <= wins[i][1] else None

    counts: dict[int, dict[str, int]] = {w[2]: {"launches": 0, "kernels": 0, "kernel_ns": 0}
                                         for w in wins}
    launch_step: dict[int, int] = {}
    for e in events:
        if str(e.device_type()).endswith("CPU") and e.name() in LAUNCH_APIS:
            n = window_of(e.start_ns())
            if n is not None:
                counts[n]["launches"] += 1
                launch_step[e.correlation_id()] = n
    for e in events:
        if str(e.device_type()).endswith("CUDA"):
            name = e.name()
            if name.startswith(("Memcpy", "Memset")):
                continue
            n = launch_step.get(e.linked_correlation_id())
            if n is not None:
                counts[n]["kernels"] += 1
                counts[n]["kernel_ns"] += e.duration_ns()
    names: dict[str, int] = {}
    for e in events:  # every device kernel the profiler saw run, by its (demangled) name
        if str(e.device_type()).endswith("CUDA") and not e.name().startswith(("Memcpy", "Memset")):
            names[e.name()] = names.get(e.name(), 0) + 1
    top = dict(sorted(names.items(), key=lambda kv: -kv[1])[:50])
    return ([{"type": "step_kernels", "step": n, **c} for n, c in sorted(counts.items())]
            + [{"type": "kernel_names", "launches": top}])


def _members(bp: Any) -> list[dict[str, Any]]:
    io = bp.inputs_and_outputs
    batch = getattr(io, "requests_in_batch", None)
    if batch is None:  # async double buffering: the pair being filled
        pair = io.io_pairs[io.current_pair]
        batch = pair.host_io.requests_in_batch
    out = []
    for fs in batch:
        st = fs.state
        prefill = st.generated_len() == 0 if hasattr(st, "generated_len") else True
        out.append({"id": st.request_id, "phase": "prefill" if prefill else "decode",
                    "tokens": int(fs.query_length), "emits": bool(fs.has_new_token)})
    return out


def install_cb(rec: Recorder) -> None:
    """Wrap the continuous-batching loop body, batch preparation and request entry."""
    from transformers.generation.continuous_batching import continuous_api as api

    Manager, Processor = api.ContinuousBatchingManager, api.ContinuousBatchProcessor
    body, prepare, add = (Manager._generation_loop_body, Processor.prepare_next_batch,
                          Manager.add_request)

    def add_request(self: Any, *a: Any, **kw: Any) -> Any:
        rid = add(self, *a, **kw)
        rec.arrived(rid)
        return rid

    def prepare_next_batch(self: Any) -> bool:
        ok = prepare(self)
        rec.pending_members = _members(self) if ok else None
        return ok

    def loop_body(self: Any, bp: Any, bootstrapping: bool) -> bool:
        import torch
        rec.maybe_flush()
        rec.start_profiler()
        n = rec.step + 1
        stream = getattr(bp.inputs_and_outputs, "compute_stream", None)
        ev = None
        if stream is not None:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record(stream)
        before = self.current_batch
        t0 = time.monotonic_ns()
        with rec.window(n):
            go = body(self, bp, bootstrapping)
        t1 = time.monotonic_ns()
        if self.current_batch != before and rec.pending_members is not None:
            if ev is not None:
                ev[1].record(stream)
            rec.step = n
            rec.step_line(t0, t1, ev, rec.pending_members)
        rec.pending_members = None
        return go

    Manager._generation_loop_body = loop_body
    Processor.prepare_next_batch = prepare_next_batch
    Manager.add_request = add_request


def install_sequential(rec: Recorder) -> None:
    """Wrap sequential ``generate`` calls: one truth step per request."""
    from transformers.cli.serving import utils as su
    from transformers.generation.utils import GenerationMixin

    ids: deque[str] = deque()  # the inference thread runs calls in submission order
    gen, stream, whole = (GenerationMixin.generate, su.GenerateManager.generate_streaming,
                          su.GenerateManager.generate_non_streaming)

    def generate_streaming(self: Any, *a: Any, **kw: Any) -> Any:
        rid = kw.get("request_id", a[4] if len(a) > 4 else "")
        ids.append(rid)
        rec.arrived(rid)
        return stream(self, *a, **kw)

    async def generate_non_streaming(self: Any, *a: Any, **kw: Any) -> Any:
        rid = kw.get("request_id", a[4] if len(a) > 4 else "")
        ids.append(rid)
        rec.arrived(rid)
        return await whole(self, *a, **kw)

    def generate(self: Any, *a: Any, **kw: Any) -> Any:
        import torch
        rec.maybe_flush()
        rec.start_profiler()
        rid = ids.popleft() if ids else "?"
        n = rec.step + 1
        cuda = torch.cuda.is_available()
        ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        if ev:
            ev[0].record()
        inputs = kw.get("input_ids", a[0] if a else None)
        t0 = time.monotonic_ns()
        with rec.window(n):
            out = gen(self, *a, **kw)
        t1 = time.monotonic_ns()
        if ev:
            ev[1].record()
        rec.step = n
        prompt = int(inputs.shape[-1]) if inputs is not None and hasattr(inputs, "shape") else 0
        rec.step_line(t0, t1, ev, [{"id": rid, "phase": "whole", "tokens": prompt,
                                    "emits": True}])
        return out

    GenerationMixin.generate = generate
    su.GenerateManager.generate_streaming = generate_streaming
    su.GenerateManager.generate_non_streaming = generate_non_streaming


def install(path: str) -> Recorder:
    rec = Recorder(Truth(path))
    signal.signal(signal.SIGUSR1, lambda *_: rec.flush_asked.set())
    install_cb(rec)
    install_sequential(rec)
    # an idle sequential server has no loop to flush from: flush from a helper thread
    # (no profiler runs there without a GPU step having started it on its own thread)

    def idle_flusher() -> None:
        while True:
            time.sleep(0.5)
            if rec.flush_asked.is_set() and rec.prof is None:
                rec.maybe_flush()

    threading.Thread(target=idle_flusher, daemon=True, name="tt-truth-flush").start()
    return rec


if PATH:
    RECORDER = install(PATH)
