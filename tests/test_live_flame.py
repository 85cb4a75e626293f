"""Flame graphs of a server whose Python and native call paths are known
(samples/gpu/flame_server.py over libttpaths.so, built without frame pointers, and the
stand-in libcuda.so.1), under real probes: every request's stacks and counts must be
the server's own record of its GPU calls, call by call.

With exact sampling (every N-th call of the thread, and the first call of each kernel
and copy kind) the samples per stack are predictable from the server's record, and so
is the split of a kernel launched from two places (rmsnorm: embed and final_norm):
each step's launches of it are split by that step's samples, else by the process's
samples so far (tracer/correlate/stacks.py). Kernels launched from one place get
exactly their launches, per request. The service is the sum of its requests; the
capture replayed gives the same flame graphs; the CLI path (default, jittered
sampling) is exact where sampling cannot matter."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from samples.gpu import flame_server
from samples.gpu.build import build_paths
from tests.live import traced, traced_cli
from tracer.events import wire
from tracer.flame import pprof

pytestmark = pytest.mark.bpf

C = wire.CONSTANTS

EVERY = 7
REQUESTS = [("tiny", 3), ("deep", 4), ("tiny", 5), ("deep", 2), ("tiny", 6), ("deep", 5)]
LEAF_NATIVE = {  # innermost Python function -> the native frames under it, innermost last
    "Model.embed": ["cuLaunchKernel"],
    "Model.final_norm": ["cuLaunchKernel"],
    "Model.attention": ["tt_attention", "tt_launch", "cuLaunchKernel"],
    "Model.mlp": ["tt_mlp", "tt_launch", "cuLaunchKernel"],
    "Model.sample": ["tt_copy_out", "cuMemcpyDtoH_v2"],
}


def _line(func, needle: str) -> int:
    lines, start = inspect.getsourcelines(func)
    for i, text in enumerate(lines):
        if needle in text:
            return start + i
    raise AssertionError(f"{needle!r} not in {func.__name__}")


M = flame_server.Model
CALLER_LINES = {  # the line each Python frame is at when the GPU call is made
    "Handler.do_POST": _line(flame_server.Handler.do_POST, "model.generate("),
    "Model.generate": _line(M.generate, "self.decode_step(layers)"),
    "Model.embed": _line(M.embed, "cuLaunchKernel("),
    "Model.attention": _line(M.attention, "self.paths.tt_attention("),
    "Model.mlp": _line(M.mlp, "self.paths.tt_mlp("),
    "Model.final_norm": _line(M.final_norm, "cuLaunchKernel("),
    "Model.sample": _line(M.sample, "self.paths.tt_copy_out("),
}
STEP_LINES = {leaf: _line(M.decode_step, f"self.{leaf.split('.')[1]}()") for leaf in LEAF_NATIVE}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return build_paths(tmp_path_factory.mktemp("gpu"))


def start_server(paths, truth: Path) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, TT_FLAME_TRUTH=str(truth))
    p = subprocess.Popen([sys.executable, "-m", "samples.gpu.flame_server", "--libcuda",
                          str(paths["libcuda"]), "--libpaths", str(paths["libttpaths"])],
                         stdout=subprocess.PIPE, text=True, env=env)
    return p, int(p.stdout.readline().split()[1])


def post(port: int, model: str, tokens: int) -> str:
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": tokens}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["id"]


@pytest.fixture(scope="module")
def run(paths, tmp_path_factory):
    """Six requests traced with exact sampling; spans, truth, capture."""
    tmp = tmp_path_factory.mktemp("flame")
    srv, port = start_server(paths, tmp / "truth.json")
    try:
        with traced(pids=[srv.pid], record=str(tmp / "cap.ttcap"), stack_every=EVERY,
                    stack_jitter=False, burst_ns=10**9, concerns=("cuda", "process",
                                                                  "sockets")) as got:
            ids = [post(port, m, n) for m, n in REQUESTS]
            time.sleep(0.5)
    finally:
        srv.kill()
    truth = json.loads((tmp / "truth.json").read_text())
    spans = {s["attributes"]["gen_ai.response.id"]: s for s in got.spans
             if s["kind"] == "SERVER"}
    return {"got": got, "ids": ids, "truth": truth, "spans": spans, "tmp": tmp}


def expected(truth: dict, ids: list[str]) -> dict[str, dict[tuple[str, str], list[float]]]:
    """Per request: (leaf function, GPU label) -> [launches, samples], from the server's
    record of its calls and the sampler's rule (see the module docstring)."""
    out: dict[str, dict[tuple[str, str], list[float]]] = {}
    k = 0
    seen_sites: set[str] = set()
    proc_norm: Counter[str] = Counter()  # rmsnorm samples by leaf, so far
    for rid in ids:
        calls = truth[rid]["calls"]
        per: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
        step: list[tuple[list[str], bool]] = []
        for call in calls:
            k += 1
            site = f"{call[0]}:{call[1]}"
            sampled = k % EVERY == 0 or site not in seen_sites
            seen_sites.add(site)
            step.append((call, sampled))
            if call[0] != "memcpy":
                continue
            # the step ends with its copy (then the sync): split it as the tracer does
            norm_seen: Counter[str] = Counter()
            for c, s in step:
                label = "[memcpy DtoH]" if c[0] == "memcpy" else c[1]
                leaf = "Model." + c[2]
                if s:
                    per[(leaf, label)][1] += 1
                if label == "rmsnorm":
                    norm_seen[leaf] += s
                else:
                    per[(leaf, label)][0] += 1
            proc_norm.update(norm_seen)
            dist = norm_seen if sum(norm_seen.values()) else proc_norm
            launches = sum(1 for c, _ in step if c[1] == "rmsnorm")
            for leaf, n in dist.items():
                if n:
                    per[(leaf, "rmsnorm")][0] += launches * n / sum(dist.values())
            step = []
        out[rid] = dict(per)
    return out


def observed(span: dict) -> dict[tuple[str, str], list[float]]:
    from tracer.correlate.stacks import from_json

    out: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for frames, n, _t, s in from_json(span["flame"]):
        leaf = [f for f in frames if f[0] == "py"][-1][1]
        out[(leaf, frames[-1][1])][0] += n
        out[(leaf, frames[-1][1])][1] += s
    return dict(out)


def test_every_request_has_exactly_its_calls_per_stack(run):
    exp = expected(run["truth"], run["ids"])
    for rid in run["ids"]:
        got = observed(run["spans"][rid])
        assert set(got) == set(exp[rid]), rid
        for key, (n, s) in exp[rid].items():
            assert got[key][1] == s, (rid, key, "samples")
            assert got[key][0] == pytest.approx(n, abs=1e-6), (rid, key, "launches")
        launches = run["spans"][rid]["attributes"]["tokentrace.gpu.kernel_launches"]
        kernel_calls = sum(n for (leaf, lbl), (n, _) in got.items() if lbl != "[memcpy DtoH]")
        assert kernel_calls == pytest.approx(launches)
    assert run["got"].report["capture.lost_gpu"] == 0
    assert run["got"].report["capture.stack_defs_lost"] == 0
    assert run["got"].report["capture.stack_python_processes"] >= 1  # the server


def test_frames_are_the_known_python_and_native_paths(run):
    from tracer.correlate.stacks import from_json

    here = str(Path(flame_server.__file__).resolve())
    for rid in run["ids"]:
        for frames, _n, _t, _s in from_json(run["spans"][rid]["flame"]):
            py = [f for f in frames if f[0] == "py"]
            native = [f[1] for f in frames if f[0] == "native"]
            leaf = py[-1][1]
            names = [f[1] for f in py[-4:]]
            assert names == ["Handler.do_POST", "Model.generate", "Model.decode_step", leaf]
            for f in py[-4:]:
                assert f[2] == here
                want = STEP_LINES[leaf] if f[1] == "Model.decode_step" else CALLER_LINES[f[1]]
                assert f[3] == want, (f, want)
            assert native[-len(LEAF_NATIVE[leaf]):] == LEAF_NATIVE[leaf], native
            # from the interpreter's call into ctypes, unwound through libffi by .eh_frame
            assert "_ctypes_callproc" in native and native.index("_ctypes_callproc") < len(
                native) - len(LEAF_NATIVE[leaf])
            assert frames[-2] == ("sep", "--", "", 0)
            assert frames[0][0] == "py" and frames[0][1] in ("_run_module_as_main", "<module>")


def test_service_is_the_sum_of_its_requests_and_the_capture_replays_the_same(run, tmp_path):
    spans_file = tmp_path / "spans.jsonl"
    spans_file.write_text("".join(json.dumps(s) + "\n" for s in run["got"].spans))
    svc = run["spans"][run["ids"][0]]["resource"]["service.name"]
    outs = {}
    for name, src in (("spans", spans_file), ("capture", run["tmp"] / "cap.ttcap")):
        r = subprocess.run([sys.executable, "-m", "tracer", "flame", str(src), "--service", svc,
                            "-o", str(tmp_path / name)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        outs[name] = tmp_path / name
    a = (outs["spans"] / "flame.folded").read_text()
    assert a == (outs["capture"] / "flame.folded").read_text()
    assert (outs["spans"] / "flame.samples.folded").read_text() == (
        outs["capture"] / "flame.samples.folded").read_text()
    total = Counter()
    for line in a.splitlines():
        stack, n = line.rsplit(" ", 1)
        total[stack.split(";")[-1]] += float(n)
    truth = Counter()
    for rid in run["ids"]:
        for c in run["truth"][rid]["calls"]:
            truth["[memcpy DtoH]" if c[0] == "memcpy" else c[1]] += 1
    assert {k: round(v, 6) for k, v in total.items()} == dict(truth)
    # one request, from the capture: the live span's stacks
    rid = run["ids"][1]
    trace = run["spans"][rid]["trace_id"]
    r = subprocess.run([sys.executable, "-m", "tracer", "flame", str(run["tmp"] / "cap.ttcap"),
                        "--request", trace, "-o", str(tmp_path / "one")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "one" / "flame.json").read_text())
    assert doc["totals"]["launches"] == pytest.approx(len(run["truth"][rid]["calls"]))
    # pprof: three sample types, the launches, Python files and lines, kernels as labels
    prof = pprof.decode((outs["spans"] / "flame.pb.gz").read_bytes())
    st = list(prof.string_table)
    assert [(st[t.type], st[t.unit]) for t in prof.sample_type] == list(pprof.SAMPLE_TYPES)
    assert sum(s.value[0] for s in prof.sample) == sum(truth.values())
    funcs = {st[f.name]: st[f.filename] for f in prof.function}
    assert funcs["Model.attention"].endswith("flame_server.py")
    assert funcs["attn_qkv"] == "" and "tt_launch" in funcs
    html = (outs["spans"] / "flame.html").read_text()
    assert "flamegraph.default()" in html and "Model.attention" in html
    assert oct((outs["spans"] / "flame.html").stat().st_mode & 0o777) == "0o600"


def test_cli_default_sampling_keeps_single_site_kernels_exact(paths, tmp_path):
    """`tokentrace run --stacks` as a user runs it (randomised sampling gaps)."""
    srv, port = start_server(paths, tmp_path / "truth.json")
    try:
        with traced_cli(["--pid", str(srv.pid), "--stacks", "--stack-every", "5",
                         "--burst-interval-us", "1000000"], str(tmp_path / "s.jsonl")) as cli:
            ids = [post(port, m, n) for m, n in REQUESTS[:3]]
    finally:
        srv.kill()
    assert cli.returncode == 0, cli.stderr
    truth = json.loads((tmp_path / "truth.json").read_text())
    spans = {}
    for line in (tmp_path / "s.jsonl").read_text().splitlines():
        s = json.loads(line)
        if s["kind"] == "SERVER":
            spans[s["attributes"]["gen_ai.response.id"]] = s
    for rid in ids:
        got = observed(spans[rid])
        want = Counter((f"Model.{c[2]}", "[memcpy DtoH]" if c[0] == "memcpy" else c[1])
                       for c in truth[rid]["calls"])
        for (leaf, label), n in want.items():
            if label != "rmsnorm":
                assert got[(leaf, label)][0] == pytest.approx(n), (leaf, label)
        norm = sum(v[0] for (leaf, label), v in got.items() if label == "rmsnorm")
        assert norm == pytest.approx(sum(n for (_l, lbl), n in want.items() if lbl == "rmsnorm"))
        attrs = spans[rid]["attributes"]
        assert attrs["tokentrace.gpu.flame"].startswith("tokentrace flame ")
        assert any("Model.attention" in s for s in attrs["tokentrace.gpu.launch_sites"])


def test_a_c_programs_calls_all_get_stacks_and_counts_stay_exact(paths, tmp_path):
    """samples/gpu/workload.c (no Python; threads, a CUDA graph every 5 steps, copies and
    NCCL calls): sampling changes no count, and every call of every kind lands in a stack
    (kept with the process: no request was in these steps) whose native frames name the
    workload's thread function."""
    from tracer.correlate.stacks import COPY, GRAPH, KERNEL, NCCL
    from tracer.events.stacks import COPY_NAMES

    env = dict(os.environ, TT_STANDIN_COUNTS=str(tmp_path / "cuda.json"),
               TT_STANDIN_NCCL_COUNTS=str(tmp_path / "nccl.json"))
    w = subprocess.Popen([str(paths["workload"]), "--wait", "--linger", "--steps", "60",
                          "--kernels", "6", "--threads", "2", "--graph-every", "5", "--nccl"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert w.stdout.readline().strip() == "ready"
    with traced(pids=[w.pid], stack_every=4, concerns=("cuda", "nccl", "process")) as got:
        w.stdin.write("go\n")
        w.stdin.flush()
        assert w.stdout.readline().strip() == "done"
        time.sleep(2.0)  # its stacks are resolved while it lives (then it may exit)
        w.stdin.write("quit\n")
        w.stdin.flush()
        assert w.wait(30) == 0
    truth = json.loads((tmp_path / "cuda.json").read_text())
    nccl = json.loads((tmp_path / "nccl.json").read_text())
    (proc,) = got.gpu["processes"]
    assert proc["kernel_launches"] == truth["launches"] == 2 * 60 * 6
    assert proc["graph_launches"] == truth["graph_launches"]
    calls = Counter()
    for (_pid, _sid, what, _h), (n, _t, _s) in got.stacks.unattributed[w.pid].items():
        calls[what] += n
    assert calls[KERNEL] == pytest.approx(truth["launches"])
    assert calls[GRAPH] == pytest.approx(truth["graph_launches"])
    names = {v: k for k, v in COPY_NAMES.items()}
    assert calls[COPY + names["HtoD"]] == pytest.approx(truth["h2d_calls"])
    assert calls[COPY + names["DtoH"]] == pytest.approx(truth["d2h_calls"])
    assert calls[NCCL + 1] == pytest.approx(nccl["allreduce"][0])  # TT_NCCL_ALLREDUCE
    frames = list(got.stacks.frames.values())
    whats = {f.what for f in frames}
    assert {KERNEL, GRAPH, NCCL + 1, COPY + names["HtoD"]} <= whats
    for f in frames:
        native = [x.split("\t")[0] for x in f.native]
        assert not f.python and "run" in native, (f.what, native, f.native_stop)
    assert got.report["capture.lost_gpu"] == 0


# ---- thread matching and stack definitions (samples/gpu/stack_cases.py) ----------------

HANDLES = 400  # distinct kernels: their definitions (up to 16 KiB each) overflow a 1 MiB ring


class _Case:
    def __init__(self, paths, case: str, n: int = 0) -> None:
        self.p = subprocess.Popen([sys.executable, "-m", "samples.gpu.stack_cases",
                                   str(paths["libcuda"]), str(paths["libttpaths"]), case, str(n)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = json.loads(self.p.stdout.readline())
        self.pid = self.p.pid

    def say(self, cmd: str) -> dict:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self) -> None:
        try:
            self.say("quit")
        except (OSError, ValueError):
            pass
        self.p.kill()


def _as_310(lay, worker_ident: int, pid: int):
    """A 3.11 layout made to match threads as 3.10's is (by ``thread_id``, the
    pthread_t, 8 bytes before ``native_thread_id``), after checking that field holds
    the worker thread's pthread_t: bpf/stacks.c's 3.10 thread matching, live."""
    import dataclasses

    from tracer.probes import pystacks

    mem = pystacks._Memory(pid)
    try:
        idents = {mem.u64(ts + lay.ts_tid - 8) for ts in pystacks.thread_states(mem, lay)}
    finally:
        mem.close()
    assert worker_ident in idents, "thread_id is not 8 bytes before native_thread_id"
    return dataclasses.replace(lay, ts_tid=lay.ts_tid - 8, tid_is_pthread=1, checks=[])


@pytest.fixture(scope="module")
def cases(paths):
    """One traced stretch (1 MiB ring, every call sampled) of: a process whose main
    thread is behind 200 newer Python threads; one with a native thread beside a Python
    thread, its threads matched the 3.10 way; one launching 400 new kernels while the
    ring buffer's consumer is held, so stack definitions are lost, then again while the
    resolver's queue is full, then again; one making 101 new stacks on a budget of 10."""
    from tracer.probes import session as probe_session
    from tracer.probes import stacks as probe_stacks

    many, native, handles = (_Case(paths, "threads", 200), _Case(paths, "native"),
                             _Case(paths, "handles", HANDLES))
    spender = _Case(paths, "handles", 100)
    hold, held = threading.Event(), threading.Event()
    real_on_record = probe_session.CaptureSession._on_record
    real_find = probe_stacks.find_interpreter

    def on_record(self, buf):
        if hold.is_set():
            held.set()
            while hold.is_set():
                time.sleep(0.01)
        return real_on_record(self, buf)

    def find(pid: int):
        lay = real_find(pid)
        return _as_310(lay, native.ready["worker"], pid) if pid == native.pid else lay

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(probe_session.CaptureSession, "_on_record", on_record)
            mp.setattr(probe_stacks, "find_interpreter", find)
            with traced(pids=[many.pid, native.pid, handles.pid, spender.pid], stack_every=1,
                        ringbuf_mb=1, concerns=("cuda", "process")) as got:
                many.say("go")
                native.say("go")
                time.sleep(0.5)  # their records are in before the consumer is held
                hold.set()
                handles.say("go")
                assert held.wait(10)
                time.sleep(0.3)
                hold.clear()
                time.sleep(0.5)
                got.sampler.resolver.max_defs = 0  # the resolver's queue is full
                handles.say("again")  # definitions sent again, dropped, unmarked
                time.sleep(0.5)
                got.sampler.resolver.max_defs = probe_stacks.MAX_QUEUED_DEFS
                lost = -1
                for _ in range(8):  # ...and sent again, until the ring had room for all
                    handles.say("again")
                    time.sleep(0.5)
                    now = got.sampler.counters()["stack_defs_lost"]
                    if now == lost:
                        break
                    lost = now
                time.sleep(1.0)  # the definitions sent again are resolved
                got.sampler.on_def(b"\x13\x00\x00\x00cut short")  # as a damaged record
                defs = got.sampler.counters()["stack_defs"]
                got.sampler.set_budget(10)
                spender.say("go")  # 101 new stacks: main_launch's, then 100 handles'
                time.sleep(0.5)
                spent = got.sampler.counters()["stack_defs"] - defs
    finally:
        for c in (many, native, handles, spender):
            c.close()
    return {"got": got, "many": many, "native": native, "handles": handles, "spent": spent}


def _frames_of(got, pid: int) -> list:
    return [f for (p, _sid), f in got.stacks.frames.items() if p == pid]


def test_a_main_thread_behind_many_newer_threads_gets_its_python_frames(cases):
    """The kernel walks only the 128 newest thread states; the main thread's is the
    oldest of 201: user space maps every thread to its state for the kernel (C5)."""
    frames = _frames_of(cases["got"], cases["many"].pid)
    assert frames
    for f in frames:
        assert not f.flags & C["STK_PY_NO_THREAD"], f
        assert any(p.startswith("main_launch\t") for p in f.python), f.python


def test_threads_matched_the_310_way_never_get_another_threads_frames(cases):
    """3.10 keeps only pthread_t: a thread is matched to the nearest thread descriptor
    above its stack pointer. A native thread (no Python state) beside a Python thread
    must get no Python frames, not its neighbour's or the main thread's (C3)."""
    frames = _frames_of(cases["got"], cases["native"].pid)
    by_site = defaultdict(list)
    for f in frames:
        natives = [x.split("\t")[0] for x in f.native]
        py = [p.split("\t")[0] for p in f.python]
        site = ("native" if "tt_worker_run" in natives else
                "worker" if "worker_launch" in py else "main" if "main_launch" in py else "?")
        by_site[site].append(f)
    assert set(by_site) == {"native", "worker", "main"}, {k: len(v) for k, v in by_site.items()}
    for f in by_site["native"]:
        assert f.python == () and f.flags & C["STK_PY_NO_THREAD"], f
    for f in by_site["worker"]:  # its own frames, matched by its own descriptor
        py = [p.split("\t")[0] for p in f.python]
        assert "main.<locals>.worker" in py and "main_launch" not in py, py


def test_stack_definitions_the_ring_buffer_lost_are_sent_again(cases):
    """Definitions lost to a full ring buffer (C4), or dropped by a full resolver queue
    (R2, counted), are sent again at the stack's next sample: every stack counted has
    its frames."""
    got, pid = cases["got"], cases["handles"].pid
    assert got.report["capture.stack_defs_lost"] > 0  # the cases at hand
    assert got.report["capture.stack_defs_dropped"] > 0
    counted = {sid for (p, _u), sids in got.stacks.by_unit.items() if p == pid for sid in sids}
    named = {sid for (p, sid) in got.stacks.frames if p == pid}
    assert len(counted) >= HANDLES and counted <= named, len(counted - named)


def test_an_undecodable_definition_is_counted_in_the_exit_report(cases):
    """R3: the resolver's count of records it could not decode is exported."""
    assert cases["got"].report["capture.stack_defs_undecodable"] == 1


def test_a_process_sends_no_more_stack_definitions_than_its_budget(cases):
    """R2: a process making ever new stacks gets its budget of definitions; the rest
    are counted, never sent (the agent's memory for it is bounded)."""
    assert cases["spent"] == 10
    assert cases["got"].report["capture.stack_defs_over_budget"] == 101 - 10
