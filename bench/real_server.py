"""What tracing costs a real server, to 1% where the host allows: traced and untraced
stretches of the same server under the same load, many of them in one run, with the
agent kept running and only its probes taken out and put back (`tokentrace run
--control`, docs of `tokentrace ctl`).

    python bench/real_server.py [--servers hf-cb,hf-plain,batching,grpc] [--device cpu]
        [--mode slices|windows] [--requests 32] [--concurrency 8] [--max-tokens 16:48]
        [--slice-s 3] [--settle-s 0.5] [--settle-resume-s S] [--warmup-s 10]
        [--min-pairs 8] [--max-pairs 400] [--target 0.01] [--budget-s 240] [--breakdown]
        [--breakdown-modes M,M] [--sample-fraction F] [--breakdown-every N] [--keep-eos]
        [--partial FILE] [--replicas N] [--agent-cpus K] [--model-shape LAYERS,HIDDEN]
        [--design alternate|crossover] [--null-every N] [--variants M,M]
        [--first-tokens-s 240] [--window-log DIR] [--out bench/results/real_server.json]
    python bench/real_server.py --pool RESULT.json [RESULT.json ...]

On an H100/H200 host (after `eval "$(.gpu/setup-bcc.sh)"`, as bench/accuracy.py runs
there), one command, under 8 minutes (~1 minute to build the model, start the server,
warm it and attach; 400 s of slices: a pair every ~9 s):

    python3 bench/real_server.py --servers hf-cb --device cuda --requests 96 \\
        --concurrency 32 --max-tokens 24:150 --slice-s 3 --budget-s 400 --min-pairs 400 \\
        --out OUT_DIR/real_server-hf-cb-h200-slices.json

Servers: HF ``transformers serve`` with ``--continuous-batching`` (``hf-cb``) and
without (``hf-plain``) on a tiny Llama built offline (a server nobody here wrote); the
continuous-batching sample (``batching``: engine thread, stand-in libcuda on the CPU so
its GPU probes fire); the KServe gRPC sample (``grpc``, streamed ModelStreamInfer
calls). The server, the load generator and the agent run on separate CPUs where the
host has them (on 2 CPUs: the agent alone on one, server and client on the other).

Fixed work per request: the tiny Llama is built with an end-of-sequence id no logit
can produce and a tokenizer that decodes every token to text of its own, so every
request generates exactly its max_tokens and streams one chunk per token (the requests
that did not are counted, ``short_requests``). ``--keep-eos`` serves the model as built.

``--mode slices`` (the default): the client keeps ``--concurrency`` streamed requests in
flight all the time, a new one as soon as one ends, from a fixed repeating mix
(``--requests`` different prompts and max_tokens; a light client of its own, raw HTTP),
and time-stamps every token chunk it receives. Once tokens flow, ``--warmup-s`` of load
before the agent attaches. The run is then a sequence of time slices of ``--slice-s``
seconds, untraced and traced in ABBA order (U T T U U T ...): one pause or resume per
pair, then ``--settle-s`` (``--settle-resume-s`` after a resume) before the next
slice; two slices of the same mode follow each other with no gap. A slice counts the
output tokens whose chunks arrived inside it, the TTFTs of the requests sent inside it,
and from /proc the CPU seconds the server (and its three busiest threads), the agent and
the client used in it; on CUDA the GPU's SM clock and utilisation (NVML, read only). No
ramp-up or drain per measurement, and the same work each request. ``switch_effects``
in the output says whether a switch leaves a transient: every pair is one slice right
after a switch and one after a slice of its own mode. ``--mode windows`` (the earlier
design, with the ``openai`` client): each window sends the whole mix once and waits
for the last response, untraced and traced windows in ABBA order.

Per pair the ratio traced/untraced. Pairs are added until the 95% interval of the mean
ratio (t over the pairs' log ratios) is narrower than ``--target`` either side, or
``--max-pairs`` / ``--budget-s`` run out: the interval is reported either way, with the
per-pair noise (``sd_log``, the standard deviation of the log ratios) and the pairs and
seconds a ``--target`` interval would take at that noise. Reported per server: tokens/s
ratio, p50 and p99 TTFT ratios (pooled; interval by resampling pairs), server CPU per
output token ratio (probe work runs in the server's own CPU time: robust to a busy
host, unless the server is held to one core by its GIL, when it is the tokens/s ratio
inverted), agent CPU per 1k requests and per 1M kernel launches (slices: launches
counted over the run, prorated to the traced slices), records the agent read per
second, and the switch times. ``--pool`` takes the pairs of several result files of
the same design together (TTFT quantiles stay per file).

A slice also holds the server's stalls (``server_stalls``: every stream silent at once
far longer than its tokens' ordinary gaps; HF serve CB stops for ~0.3 s every 85-100 s
whether traced or not) and the TTFTs of the requests that waited through one: the
output counts them by mode (``stalls``, with full's rate over untraced's) and gives the
p99 TTFT ratio without those requests too (``ttft_p99_outside_stalls``). ``--window-log
DIR`` keeps what a request-by-request reading needs (each agent's capture, every
token's and request's times, the slices' spans) for ``bench/window_effect.py``.

``--replicas N`` (slices only): N servers of the same kind at once, each with its own
client, work directory, port and CPUs (``--agent-cpus`` for the agent first, then per
replica 2 CPUs for its client and an equal share of the rest for its server; a host
with fewer than ``--agent-cpus`` + 3N puts everything on every CPU, says so on stderr
and records ``cpus_shared``), on CUDA replica i on GPU i mod the host's GPUs
(``CUDA_VISIBLE_DEVICES``; more replicas than GPUs share them: ``replicas_per_gpu``),
all traced by ONE agent (``tokentrace run --pid P1 --pid P2 ...``, as a node's agent
would be) and switched together. Every time slice then measures every replica: N pairs
per round instead of one. Why: on an H100/H200 HF serve with continuous batching (a
GIL-bound server) one pair's log ratio has sd ~0.11, so a ±1% interval needs ~500 pairs
(~80 minutes of slices) where a session has ~20 minutes of GPU time; 4 GPUs give 4
pairs a round. The replicas are not independent (they share the switch moments, the
agent and the host), so the interval is over ROUNDS: per round the mean of its
replicas' log ratios, a t-interval over those means (cluster-robust; with one replica
exactly the interval above). Correlated replicas therefore cannot make it too narrow:
perfectly correlated ones give the one-replica interval, independent ones one sqrt(N)
narrower. Reported with it: ``pairs`` (rounds x replicas), ``rounds``, ``sd_log`` (per
pair, pooled), ``sd_log_round_mean``, ``replica_correlation`` (mean pairwise
correlation of the replicas' per-round log ratios) and ``effective_pairs`` (the
independent pairs the run was worth); ``rounds_for_target`` / ``pairs_for_target`` /
``seconds_for_target`` and the ``--target`` stopping rule use the round means' noise,
and ``--min-pairs`` / ``--max-pairs`` count rounds. The same holds for server CPU per
token, the parts, ``server_sys`` and ``switch_effects`` (its sequences per replica);
the TTFT intervals resample whole rounds. ``per_replica`` gives each replica's own
ratios (a bad GPU shows there), ``load_per_replica`` each client's totals (``load``:
their sum). Slice records carry ``replica``; the agent's CPU and records of a time
slice are split evenly among its replicas' records, the kernel's per-program census and
the server syscall counts (all servers together) are on replica 0's record. On a
4-GPU host (64 CPUs), one command, ~10 minutes:

    python3 bench/real_server.py --servers hf-cb --device cuda --replicas 4 \\
        --budget-s 480 --settle-resume-s 1.5 --agent-args="--gpu-sample auto" \\
        --out OUT_DIR/real_server-hf-cb-h100x4.json

``--design crossover`` (slices, an even ``--replicas``): two agents, each tracing half
the replicas (i % 2), one half traced and the other not in every time slice, the halves
swapped in ABBA order. A round still gives each replica one traced and one untraced
slice (the statistics are the same), but its mean now sets each half's traced slice
against the other half's at the same moment, so the host's own drift, shared by the
replicas, cancels: on 4 H100s the noise of a round's mean fell from 0.089 to
0.012-0.031 (docs/overhead.md, "a crossover design"). What it leaves out: the untraced
half runs beside the traced half's global probes (the socket and TCP tracepoints'
early returns), and on a GPU the two halves share, beside its work; ``--null-every N``
adds to every Nth round a slice with neither half traced (``none-traced``) to measure
that, at each place of its round in turn. ``place_adjusted`` in the output takes the
places out (a round's first slice can be slower in every mode; each run pooled has
its own): each mode against untraced, and ``full_vs_none-traced``, full tracing
against a host where nothing is traced, which is what a node whose every server is
traced pays if the untraced half is itself slowed by the other's tracing (two servers
on one H100, ten calls: the untraced half 1.002 (0.989-1.014) with nothing traced, not
resolved; docs/overhead.md, "four more null-every-round calls").

``--breakdown`` adds slices (windows) with one part of the tracer off while the rest
traces (payload copies: capture-limit 1 byte; the agent's analysis: records read and
dropped; on GPU servers the kernel-launch uprobes, the stub-naming window, the
cuKernelGetFunction look-up window held open, and ``--burst-min-us 1000``), or one mode
more (``census``: full tracing with the kernel's
per-program statistics on; ``sampled``: ``--gpu-sample --sample-fraction`` switched on
while running; ``sampled-copies``: the same with the sampled copies' probes
switched with the launch probes; ``sockets-only``: every uprobe out, the socket and TCP
probes in: the floor of any duty cycle of the GPU probes; ``period-2``, ``period-4``:
``--gpu-sample-period`` 2 or 4 s set while running, auto's window opened half or a
quarter as often), and reports each part's share
of the server's added CPU;
``--breakdown-modes`` picks some. Every slice also records the server's system CPU,
where the probes' own cost is paid (uprobe traps, tracepoint programs): ``server_sys``
gives each mode's added system CPU per second over the untraced slice of its round,
with its 95% interval, a far less noisy measure than tokens/s on a GIL-bound server.
``census`` gives each BPF program's runs per second and per output token and its mean
run time, and the server's syscalls per second by name (counted by the bench on
``raw_syscalls:sys_enter``, in the census slices only). ``slow-path``: no probe of the
agent's, only a do-nothing syscall tracepoint the bench holds (``bench/syscall_watch.py``):
while any syscall tracepoint is attached every syscall of every task takes the kernel's
slow path, so the socket probes also tax the server's futex, ioctl and sched_yield calls.
``agent-load``: no probe of the agent's, a load of ``--agent-load`` cores of cache-heavy
Python work on the agent's CPUs instead (bench/host_speed.py): what a busy agent costs
the servers beside it through the host alone. ``--speed-meter`` runs
bench/host_speed.py's meters on two unused CPUs: whether the host itself runs slower in
a mode (``host_speed``). Every slice records the servers' context switches and run-queue
delay (``server_sched``); ``--server-cpus`` gives the replicas CPU plans of their own.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracer.probes.bpfstats import ProgramCost, parse_costs

CLK = os.sysconf("SC_CLK_TCK")


# ---- processes ------------------------------------------------------------------------


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU of a process (all its threads). System CPU is where a
    uprobe's trap and a syscall tracepoint's BPF program are spent (they run in the
    traced thread, in the kernel)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    return int(f[11]) / CLK, int(f[12]) / CLK


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads)."""
    return sum(cpu_times(pid))


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
                todo += [int(k) for k in kids]
        except OSError:
            pass
    return out


def tree_cpu(pid: int) -> float:
    return sum(cpu_seconds(p) for p in tree(pid))


def tree_times(pid: int) -> tuple[float, float]:
    """All CPU and system CPU of ``pid`` and its descendants."""
    times = [cpu_times(p) for p in tree(pid)]
    return sum(u + k for u, k in times), sum(k for _, k in times)


def tree_threads(pid: int) -> Iterator[str]:
    """``/proc/P/task/T`` of every thread of ``pid`` and of its descendants."""
    for p in tree(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            yield f"/proc/{p}/task/{t}"


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of ``pid`` and of its descendants."""
    out = {}
    for task in tree_threads(pid):
        try:
            f = Path(f"{task}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.rsplit("/", 1)[1])] = (int(f[11]) + int(f[12])) / CLK
    return out


def sched_stats(pid: int) -> tuple[int, int, int]:
    """Context switches (voluntary, involuntary) and nanoseconds spent runnable but
    waiting for a CPU (``schedstat``'s second field), summed over every thread of
    ``pid`` and its descendants: a traced server that hands its GIL over more often, or
    waits on a run queue more, shows it here."""
    vol = invol = delay = 0
    for task in tree_threads(pid):
        try:
            status = Path(f"{task}/status").read_text()
            sched = Path(f"{task}/schedstat").read_text().split()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                vol += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                invol += int(line.split()[1])
        delay += int(sched[1]) if len(sched) > 1 else 0
    return vol, invol, delay


class GpuClocks:
    """A GPU's SM clock and utilisation sampled every 0.1 s through NVML (read only),
    to see whether a slice's throughput follows them; absent without pynvml. ``index``:
    NVML's (PCI bus order, as ``CUDA_DEVICE_ORDER=PCI_BUS_ID``)."""

    def __init__(self, index: int = 0) -> None:
        import pynvml
        pynvml.nvmlInit()
        self.nv = pynvml
        self.h = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.samples: list[tuple[float, int, int]] = []
        self.running = True
        threading.Thread(target=self.loop, daemon=True).start()

    def loop(self) -> None:
        nv = self.nv
        while self.running:
            try:
                self.samples.append((time.monotonic(),
                                     nv.nvmlDeviceGetClockInfo(self.h, nv.NVML_CLOCK_SM),
                                     nv.nvmlDeviceGetUtilizationRates(self.h).gpu))
            except nv.NVMLError:
                return
            time.sleep(0.1)

    def mean(self, t0: float, t1: float) -> dict[str, float] | None:
        xs = [(c, u) for t, c, u in self.samples if t0 <= t < t1]
        if not xs:
            return None
        return {"sm_mhz": round(statistics.fmean(c for c, _ in xs), 1),
                "util_pct": round(statistics.fmean(u for _, u in xs), 1)}


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` and of its descendants onto ``cpus``."""
    for p in tree(pid):
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                try:
                    os.sched_setaffinity(int(t), cpus)
                except OSError:
                    pass
        except OSError:
            pass


@dataclass
class CpuPlan:
    """Where the agent and each replica's client and server run."""

    agent: set[int]
    lanes: list[dict[str, set[int]]]  # per replica: "client", "server"
    shared: bool = False  # the host was too small: everything on every CPU
    unused: set[int] = field(default_factory=set)

    def narrow_servers(self, counts: list[int]) -> None:
        """Replica i's server on the first ``counts[i]`` CPUs of its share only (the last
        count for the replicas after the list's end; the rest of its share unused):
        how the server's CPUs shape its noise and its overhead, compared in one run."""
        for i, lane in enumerate(self.lanes):
            keep = sorted(lane["server"])[:counts[min(i, len(counts) - 1)]]
            self.unused |= lane["server"] - set(keep)
            lane["server"] = set(keep)

    def as_json(self) -> dict[str, Any]:
        """``agent`` and per replica ``{client, server}``; with one replica also today's
        flat ``client`` and ``server``."""
        out: dict[str, Any] = {"agent": sorted(self.agent)}
        if len(self.lanes) == 1:
            out.update({k: sorted(v) for k, v in self.lanes[0].items()})
        out["replicas"] = [{k: sorted(v) for k, v in lane.items()} for lane in self.lanes]
        if self.unused:
            out["unused"] = sorted(self.unused)
        return out


def plan_lanes(replicas: int = 1, agent_cpus: int = 1, n: int | None = None) -> CpuPlan:
    """The agent on the first ``agent_cpus`` CPUs, then per replica a block of an equal
    share of the rest: its client on the block's first 2 CPUs, its server on the others.
    One replica and one agent CPU: the plan of old (client on 1 CPU below 6 CPUs; on 2
    CPUs the agent alone on one). A host with fewer than ``agent_cpus`` + 3 per replica:
    everything on every CPU, said on stderr and marked ``shared``."""
    cpus = sorted(os.sched_getaffinity(0)) if n is None else list(range(n))
    rest = cpus[agent_cpus:]
    if replicas == 1 and agent_cpus == 1 and len(cpus) == 2:
        return CpuPlan({cpus[1]}, [{"client": {cpus[0]}, "server": {cpus[0]}}])
    if replicas == 1 and len(rest) >= 2:
        c = 2 if len(rest) >= 5 else 1
        return CpuPlan(set(cpus[:agent_cpus]),
                       [{"client": set(rest[:c]), "server": set(rest[c:])}])
    if replicas > 1 and len(rest) >= 3 * replicas:
        block = len(rest) // replicas
        lanes = [{"client": set(rest[i * block:i * block + 2]),
                  "server": set(rest[i * block + 2:(i + 1) * block])} for i in range(replicas)]
        return CpuPlan(set(cpus[:agent_cpus]), lanes, unused=set(rest[block * replicas:]))
    print(f"warning: {len(cpus)} CPU(s) are too few to keep the agent ({agent_cpus}) and "
          f"{replicas} replica(s) apart (a client and a server each; 3 CPUs each for "
          "several): everything runs on every CPU (cpus_shared)", file=sys.stderr, flush=True)
    every = set(cpus)
    return CpuPlan(set(every), [{"client": set(every), "server": set(every)}
                                for _ in range(replicas)], shared=True)


def plan_cpus(n: int | None = None) -> dict[str, set[int]]:
    """Agent, server and client CPUs of one replica: apart where the host has enough."""
    plan = plan_lanes(1, 1, n)
    return {"agent": plan.agent, **plan.lanes[0]}


def gpu_count() -> int:
    """The host's NVIDIA GPUs: its /dev/nvidiaN nodes, else ``nvidia-smi -L``'s lines."""
    n = len(list(Path("/dev").glob("nvidia[0-9]*")))
    if n:
        return n
    try:
        out = subprocess.run(["nvidia-smi", "-L"], check=False, capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def replica_gpus(replicas: int, device: str) -> list[str | None]:
    """Each replica's GPU (its ``CUDA_VISIBLE_DEVICES``): replica i on GPU i mod the GPUs
    (those ``CUDA_VISIBLE_DEVICES`` lists, if set; else all the host's). None on the
    CPU, or where no GPU is found."""
    if device != "cuda":
        return [None] * replicas
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = ([x.strip() for x in visible.split(",") if x.strip()] if visible is not None
           else [str(i) for i in range(gpu_count())])
    if not ids:
        print("warning: no GPU found: the replicas share whatever CUDA picks",
              file=sys.stderr, flush=True)
        return [None] * replicas
    return [ids[i % len(ids)] for i in range(replicas)]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill_group(p: subprocess.Popen[Any]) -> None:
    try:
        os.killpg(p.pid, signal.SIGTERM)
        os.killpg(p.pid, signal.SIGCONT)  # a stopped one gets it too
        p.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
        except ProcessLookupError:
            pass


def wait_http(url: str, proc: subprocess.Popen[Any], log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"server did not start: {log.read_text()[-3000:]}")


def fixed_work(model: Path) -> None:
    """Make the tiny Llama at ``model`` generate exactly max_tokens every request and
    stream one chunk per token: its end-of-sequence id becomes the vocabulary's size
    (no logit is that token, so no request ends early; continuous batching and
    ``generate`` both stop on ids only), and its tokenizer decodes every token to text
    of its own (no byte-level decoder, whose partial UTF-8 bytes decode to nothing
    until a later token completes them; no special tokens, which the server's streamer
    skips). What is sampled and computed per step is unchanged."""
    for name in ("config.json", "generation_config.json"):
        f = model / name
        cfg = json.loads(f.read_text())
        cfg["eos_token_id"] = json.loads((model / "config.json").read_text())["vocab_size"]
        f.write_text(json.dumps(cfg, indent=1))
    f = model / "tokenizer.json"
    tok = json.loads(f.read_text())
    tok["decoder"] = None
    for t in tok.get("added_tokens", []):
        t["special"] = False
    f.write_text(json.dumps(tok))
    f = model / "tokenizer_config.json"
    cfg = json.loads(f.read_text())
    for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
        cfg.pop(k, None)  # named, they would be marked special again at load
    f.write_text(json.dumps(cfg, indent=1))


def tiny_llama(work: Path, keep_eos: bool = False, shape: tuple[int, int] = (2, 128)) -> Path:
    """The tiny Llama built in ``work`` (and made to do fixed work, ``fixed_work``, unless
    ``keep_eos``): build it once, serve it from several servers. ``shape``: its layers
    and hidden size (``--model-shape``; larger ones give each token more GPU work)."""
    from samples.hf.model import build
    model = build(work / "tiny-llama", layers=shape[0], hidden=shape[1])
    if not keep_eos:
        fixed_work(model)
    return model


class Server:
    """One server process (group), its URL or gRPC target, and how to load it.

    ``env``: more environment (a replica's ``CUDA_VISIBLE_DEVICES``); ``model``: an HF
    kind's model directory, built already (default: the tiny Llama built in ``work``);
    ``wait=False``: return once started, ``ready()`` waits for it to serve (several
    servers start at once). ``gpu_sharers``: how many servers share its GPU
    (``cb_memory_args``)."""

    def __init__(self, kind: str, device: str, work: Path, cpus: set[int],
                 keep_eos: bool = False, env: dict[str, str] | None = None,
                 model: Path | None = None, wait: bool = True, gpu_sharers: int = 1) -> None:
        self.kind = kind
        self.log = work / f"{kind}.log"
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
                   **(env or {}))
        self.port = free_port()
        self.model = "tiny-gpt"
        if kind in ("hf-cb", "hf-plain"):
            self.model = str(model if model is not None else tiny_llama(work, keep_eos))
            cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", self.model,
                   "--device", device, "--port", str(self.port), "--host", "127.0.0.1",
                   *(["--continuous-batching"] if kind == "hf-cb" else []),
                   *(cb_memory_args(gpu_sharers) if kind == "hf-cb" and device == "cuda" else [])]
        elif kind == "batching":
            from samples.gpu.build import build as build_gpu
            cmd = [sys.executable, "-m", "samples.batching.server", "--port", str(self.port),
                   "--layout", "thread", "--device", device, "--truth", str(work / "truth.jsonl"),
                   "--max-batch", "16"]
            if device == "cpu":
                cmd += ["--libcuda", str(build_gpu(work / "gpu")["libcuda"])]
        elif kind == "grpc":
            cmd = [sys.executable, "-m", "samples.kserve_grpc_server", "--port", str(self.port),
                   "--device", device]
        else:
            raise SystemExit(f"unknown server {kind}")
        self.cmd, self.env, self.cpus = cmd, env, cpus
        self._spawn()
        if wait:
            self.ready()

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env,
                                     stdout=open(self.log, "a"), stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     preexec_fn=lambda: os.sched_setaffinity(0, self.cpus))
        self.url = f"http://127.0.0.1:{self.port}"

    def restart(self) -> None:
        """Stop it and start it again on a new port (its log goes on); ``ready()``
        waits for it."""
        self.stop()
        self.port = free_port()
        self.cmd[self.cmd.index("--port") + 1] = str(self.port)
        with open(self.log, "a") as f:
            f.write(f"\n---- restarted on port {self.port} ----\n")
        self._spawn()

    def ready(self) -> None:
        """Wait until the server serves (raises if it does not)."""
        if self.kind == "grpc":
            from samples.launch_grpc import GrpcSampleServer
            probe = GrpcSampleServer(port=self.port)
            deadline = time.monotonic() + 120
            while not probe._healthy():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"grpc server did not start: {self.log.read_text()[-2000:]}")
                time.sleep(0.3)
        else:
            wait_http(self.url + ("/health" if self.kind != "batching" else "/v1/models"),
                      self.proc, self.log)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        kill_group(self.proc)


# ---- the load generator (its own process) -----------------------------------------------


def client_main(args: argparse.Namespace) -> int:
    """``--client``: commands on stdin, one JSON line back for each.

    ``window``: the whole mix once at ``--concurrency`` (``--mode windows``).
    ``start``: keep ``--concurrency`` requests in flight from then on, the mix repeated,
    every token chunk time-stamped (``--mode slices``). ``slice T0 T1`` (monotonic
    seconds, the clock is the host's): the tokens that arrived in [T0, T1) and the
    requests sent in it. ``stop``: no new requests; the totals. ``dump PATH``: every
    token's arrival and every request's send time and TTFT so far, to PATH (JSON)."""
    from samples.batching.load import Mix, make_jobs
    lo, hi = (int(x) for x in args.max_tokens.split(":"))
    jobs = make_jobs(args.requests, 7, Mix(model=args.model, max_tokens=(lo, hi),
                                           words=(5, 60), stream_share=1.0, usage_share=1.0,
                                           chat_share=0.5))
    load: Load | None = None
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "window":
            one = (_grpc_sender(args.url) if args.client_kind == "grpc"
                   else _openai_sender(args.url, args.model))
            reply = window(one, jobs, args.concurrency)
        elif words[0] == "start" and load is None:
            one = (_grpc_sender(args.url) if args.client_kind == "grpc"
                   else _http_sender(args.url, args.model))
            load = Load(one, jobs, args.concurrency)
            reply = {"started": True}
        elif words[0] == "slice" and load is not None:
            reply = load.slice(float(words[1]), float(words[2]))
        elif words[0] == "stop" and load is not None:
            reply = load.stop()
        elif words[0] == "dump" and load is not None and len(words) == 2:
            reply = load.dump(Path(words[1]))
        else:
            reply = {"error": f"unknown command {line.strip()!r}"}
        print(json.dumps(reply), flush=True)
    return 0


def window(one: Any, jobs: list[Any], concurrency: int) -> dict[str, Any]:
    """Send every job once over ``concurrency`` threads; what the client saw."""
    results: list[tuple[float | None, int]] = []
    errors, short = [0], [0]
    lock = threading.Lock()
    queue = list(jobs)

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                job = queue.pop()
            try:
                r = one(job)
            except Exception:  # counted: a window with errors is reported as such
                with lock:
                    errors[0] += 1
                continue
            with lock:
                results.append(r)
                short[0] += r[1] != job.max_tokens

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    return {"wall_s": wall, "requests": len(results), "errors": errors[0],
            "short_requests": short[0], "tokens": sum(n for _, n in results),
            "ttft_ms": [round(t * 1e3, 3) for t, _ in results if t is not None]}


# A stall of the whole server: no stream had a token for STALL_FACTOR times the 99th
# percentile of the gaps between tokens of every stream merged (over the STALL_BASIS_S
# before the slice's end), and at least STALL_MIN_S. HF serve CB on an H200 (8 streams)
# merges to a p99 of 12-13 ms and a longest ordinary silence of 37 ms, and stops every
# 85-100 s for 290-375 ms in every mode, untraced and between slices too
# (docs/overhead.md).
STALL_FACTOR = 10.0
STALL_MIN_S = 0.05
STALL_BASIS_S = 30.0
STALL_MIN_GAPS = 200  # fewer merged gaps than this in the basis: no threshold


def server_stalls(stamps: Sequence[Sequence[float]], t0: float, t1: float
                  ) -> tuple[list[tuple[float, float]], float | None]:
    """The server's stalls overlapping [t0, t1) (monotonic seconds, start and end),
    from each stream's token arrival times (each list sorted), and the silence that
    counted as one (None: too few tokens to say; then no stalls)."""
    from bisect import bisect_left
    merged = sorted(t for s in stamps
                    for t in s[bisect_left(s, t1 - STALL_BASIS_S):bisect_left(s, t1 + 1.0)])
    gaps = sorted(b - a for a, b in itertools.pairwise(merged))
    if len(gaps) < STALL_MIN_GAPS:
        return [], None
    threshold = max(STALL_MIN_S, STALL_FACTOR * gaps[int(0.99 * (len(gaps) - 1))])
    return [(a, b) for a, b in itertools.pairwise(merged)
            if b - a >= threshold and a < t1 and b > t0], threshold


def touches(a: float, b: float, spans: Sequence[tuple[float, float]]) -> bool:
    """Whether [a, b] overlaps any of ``spans``."""
    return any(a < e and b > s for s, e in spans)


def slice_stalls(stamps: Sequence[Sequence[float]],
                 first: Sequence[Sequence[tuple[float, float | None]]], t0: float,
                 t1: float) -> dict[str, Any]:
    """A slice's stalls of the whole server (``server_stalls``: start from ``t0`` and
    length, seconds; the silence that counted as one) and the TTFTs (ms) of the
    requests sent in it that waited through one, from each stream's token times and
    its requests' (sent, TTFT) (``Load``)."""
    from bisect import bisect_left
    stalls, threshold = server_stalls(stamps, t0, t1)
    stalled = []
    for reqs in first:
        keys = [f[0] for f in reqs]
        for sent, wait in reqs[bisect_left(keys, t0):bisect_left(keys, t1)]:
            if wait is not None and touches(sent, sent + wait, stalls):
                stalled.append(round(wait * 1e3, 3))
    return {"stalls": [[round(a - t0, 4), round(b - a, 4)] for a, b in stalls],
            "stall_threshold_s": round(threshold, 4) if threshold else None,
            "ttft_stalled_ms": stalled}


class Load:
    """Continuous closed-loop load: ``concurrency`` threads, each sending the next job
    of the repeating mix as soon as its last request ended. Each thread keeps its own
    time-ordered lists (token chunk arrival times; per request, at its first token:
    sent and TTFT; at its end: sent, tokens, max_tokens, error), so a slice is a binary
    search in each."""

    def __init__(self, one: Any, jobs: list[Any], concurrency: int) -> None:
        self.one = one
        self.jobs = itertools.cycle(jobs)
        self.lock = threading.Lock()
        self.running = True
        n = concurrency
        self.stamps: list[list[float]] = [[] for _ in range(n)]
        self.first: list[list[tuple[float, float | None]]] = [[] for _ in range(n)]
        self.done: list[list[tuple[float, int, int, bool]]] = [[] for _ in range(n)]
        self.threads = [threading.Thread(target=self.worker, args=(i,), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def worker(self, i: int) -> None:
        stamps, first, done = self.stamps[i], self.first[i], self.done[i]
        tick = time.monotonic
        while self.running:
            with self.lock:
                job = next(self.jobs)
            n = [0]
            t0 = tick()

            def token(n: list[int] = n, t0: float = t0) -> None:
                t = tick()
                stamps.append(t)
                if not n[0]:
                    first.append((t0, t - t0))
                n[0] += 1
            try:
                self.one(job, token)
                err = False
            except Exception:  # counted in the slice the request was sent in
                err = True
            if not n[0]:
                first.append((t0, None))
            done.append((t0, n[0], job.max_tokens, err))
            if err:
                time.sleep(0.05)

    def slice(self, t0: float, t1: float) -> dict[str, Any]:
        """Tokens that arrived in [t0, t1); TTFTs of the requests sent in it that have
        had their first token; errors and short requests among those that ended; the
        server's stalls in it (``server_stalls``: start from t0 and length, seconds)
        and the TTFTs among those of requests that waited through one."""
        from bisect import bisect_left
        while time.monotonic() < t1 + 0.05:  # a chunk stamped just before t1 is listed
            time.sleep(0.01)
        tokens = sum(bisect_left(s, t1) - bisect_left(s, t0) for s in self.stamps)
        ttft: list[float] = []
        started = errors = short = 0
        for first, done in zip(self.first, self.done):
            keys = [f[0] for f in first]
            for k in range(bisect_left(keys, t0), bisect_left(keys, t1)):
                started += 1
                if first[k][1] is not None:
                    ttft.append(round(first[k][1] * 1e3, 3))
            keys = [d[0] for d in done]
            for k in range(bisect_left(keys, t0), bisect_left(keys, t1)):
                _, n, mx, err = done[k]
                errors += err
                short += (not err and n != mx)
        return {"tokens": tokens, "requests": started, "errors": errors,
                "short_requests": short, "ttft_ms": ttft,
                **slice_stalls(self.stamps, self.first, t0, t1)}

    def dump(self, path: Path) -> dict[str, Any]:
        """Each thread's token arrival times and (sent, TTFT) of its requests
        (monotonic seconds), to ``path`` as JSON (``--window-log``)."""
        path.write_text(json.dumps({"stamps": self.stamps, "first": self.first},
                                   separators=(",", ":")))
        return {"dumped": str(path), "tokens": sum(len(s) for s in self.stamps)}

    def stop(self) -> dict[str, Any]:
        self.running = False
        for t in self.threads:
            t.join(120)
        done = [d for ds in self.done for d in ds]
        return {"requests": len(done), "errors": sum(d[3] for d in done),
                "short_requests": sum(1 for d in done if not d[3] and d[1] != d[2]),
                "tokens": sum(d[1] for d in done),
                "still_running": sum(t.is_alive() for t in self.threads)}


def _openai_sender(url: str, model: str) -> Any:
    import openai

    from samples.batching.load import send
    local = threading.local()

    def one(job: Any) -> tuple[float | None, int]:
        if not hasattr(local, "client"):
            local.client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="none",
                                         max_retries=0, timeout=300)
        _, seen = send(local.client, job, model)
        return (seen.ttft_ns / 1e9 if seen.ttft_ns else None), seen.tokens
    return one


def _http_sender(url: str, model: str) -> Any:
    """The same requests as the ``openai`` client sends (chat or completions, streamed,
    with usage), over one keep-alive connection per thread, read line by line: a
    lighter client, so that the client's own CPU does not pace a fast server. Calls
    ``token()`` at each chunk with text (one per token: ``fixed_work``)."""
    import http.client
    from urllib.parse import urlsplit
    u = urlsplit(url)
    local = threading.local()
    headers = {"Content-Type": "application/json", "Authorization": "Bearer none"}

    def one(job: Any, token: Any = None) -> tuple[float | None, int]:
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
        body: dict[str, Any] = {"model": model, "max_tokens": job.max_tokens, "stream": True,
                                "stream_options": {"include_usage": True}}
        if job.chat:
            path, key = "/v1/chat/completions", "delta"
            body["messages"] = [{"role": "user", "content": job.prompt}]
        else:
            path, key = "/v1/completions", None
            body["prompt"] = job.prompt
        t0 = time.monotonic()
        first, n = None, 0
        try:
            conn.request("POST", path, json.dumps(body), headers)
            r = conn.getresponse()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
            while True:
                line = r.readline()
                if not line:
                    break
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    r.read()  # the chunked body's end: the connection is reused
                    break
                doc = json.loads(data)
                if "error" in doc:
                    raise RuntimeError(str(doc["error"])[:200])
                for c in doc.get("choices") or ():
                    text = (c.get("delta") or {}).get("content") if key else c.get("text")
                    if text:
                        n += 1
                        if first is None:
                            first = time.monotonic() - t0
                        if token is not None:
                            token()
        except Exception:
            conn.close()
            local.conn = None
            raise
        return first, n
    return one


def _grpc_sender(url: str) -> Any:
    import grpc

    from protocols.proto import grpc_predict_v2_pb2 as pb
    from protocols.proto import grpc_predict_v2_pb2_grpc as pbg
    from samples.kserve_grpc_server import bytes_tensor
    import struct
    target = url.replace("http://", "")
    local = threading.local()

    def one(job: Any, token: Any = None) -> tuple[float | None, int]:
        if not hasattr(local, "stub"):
            local.stub = pbg.GRPCInferenceServiceStub(grpc.insecure_channel(target))
        req = pb.ModelInferRequest(model_name="tiny-gpt", id=f"r{random.getrandbits(32)}")
        req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        req.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
        req.raw_input_contents.append(bytes_tensor([job.prompt.encode()]))
        req.raw_input_contents.append(struct.pack("<i", job.max_tokens))
        t0 = time.monotonic()
        first, n = None, 0
        for resp in local.stub.ModelStreamInfer(iter([req]), timeout=300):
            if resp.error_message:
                raise RuntimeError(resp.error_message)
            if resp.infer_response.raw_output_contents:
                n += 1
                if first is None:
                    first = time.monotonic() - t0
                if token is not None:
                    token()
        return first, n  # read to its end: leaving early would cancel (reset) the stream
    return one


class Client:
    def __init__(self, server: Server, args: argparse.Namespace, cpus: set[int]) -> None:
        cmd = [sys.executable, str(Path(__file__)), "--client", server.url,
               "--client-kind", "grpc" if server.kind == "grpc" else "openai",
               "--model", server.model, "--requests", str(args.requests),
               "--concurrency", str(args.concurrency), "--max-tokens", args.max_tokens]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        self.cpus = cpus

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the load generator died")
        reply = json.loads(line)
        if "error" in reply and isinstance(reply["error"], str):
            raise RuntimeError(reply["error"])
        return reply

    def window(self) -> dict[str, Any]:
        return self.ask("window")

    def slice(self, t0: float, t1: float) -> dict[str, Any]:
        return self.ask(f"slice {t0!r} {t1!r}")

    def first_tokens(self, timeout: float = 600, since: float | None = None) -> float:
        """Seconds until tokens flow after ``start`` (a server's first request can take
        long: the engine is set up then), or after ``since`` (monotonic)."""
        t0 = time.monotonic() if since is None else since
        while not self.slice(time.monotonic() - 1.0, time.monotonic())["tokens"]:
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"no tokens in {timeout:g} s")
        return round(time.monotonic() - t0, 1)

    @property
    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


# ---- the agent ---------------------------------------------------------------------------


AGENT_START_S = 180.0  # a tokentrace run that has not attached by then is stuck


class Agent:
    """`tokentrace run --pid SERVER [--pid SERVER ...] --control SOCK` on its own CPU,
    kept running: one agent for every replica, as a node's agent would trace them."""

    def __init__(self, server: Server | Sequence[Server], work: Path, cpus: set[int],
                 extra: list[str], profile: str | None = None, name: str = "",
                 root: Path = ROOT, env: dict[str, str] | None = None) -> None:
        """``root``: the checkout whose tracer runs (bench/probe_ab.py compares two);
        ``env``: more of its environment."""
        from tracer.control import send
        self.send = send
        # name: agents of one run told apart (--design crossover: one per half)
        self.sock = str(work / f"agent{name}.sock")
        self.summary = work / f"summary{name}.json"
        self.jsonl = work / f"spans{name}.jsonl"
        servers = list(server) if isinstance(server, Sequence) else [server]
        pids = [a for s in servers for a in ("--pid", str(s.pid))]
        # "full" counts every launch (not --gpu-sample auto's choice): the "sampled"
        # mode is what auto switches a busy step engine to
        # profile: under cProfile, with the garbage collector's time (bench/profiled_agent.py)
        head = ([sys.executable, "-m", "tracer"] if profile is None else
                [sys.executable, str(ROOT / "bench" / "profiled_agent.py"), profile])
        cmd = [*head, "run", *pids,
               "--control", self.sock, "--quiet", "--jsonl", str(self.jsonl),
               "--summary", str(self.summary), "--gpu-sample", "1", *extra]
        self.proc = subprocess.Popen(cmd, cwd=root, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, **(env or {})),
                                     preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        assert self.proc.stderr is not None
        # stderr read all along by a thread (a pipe left unread fills and stops the
        # agent at its next warning), and also kept in a file (TOKENTRACE_BENCH_LOGS)
        self.lines: list[str] = []
        self._attached = threading.Event()
        logs = os.environ.get("TOKENTRACE_BENCH_LOGS")
        self._log = open(Path(logs, f"agent{name}.stderr"), "a") if logs else None
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        if not self._attached.wait(AGENT_START_S):
            self.proc.kill()
            raise RuntimeError(f"tokentrace run did not attach in {AGENT_START_S:.0f} s:\n"
                               + "".join(self.lines[-40:]))
        if not any("attached" in line for line in self.lines):
            raise RuntimeError("tokentrace run exited:\n" + "".join(self.lines[-40:]))
        self.stderr = ""

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if self._log is not None:
                self._log.write(line)
                self._log.flush()
            if "attached" in line:
                self._attached.set()
        self._attached.set()  # exited: the caller finds out

    def ctl(self, command: str) -> str:
        reply = self.send(self.sock, command, timeout=120)
        if not reply.startswith("ok"):
            raise RuntimeError(f"{command}: {reply}")
        return reply

    def records(self) -> int:
        reply = self.ctl("status")
        return int(reply.rsplit("records=", 1)[1].split()[0])

    @property
    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> dict[str, Any]:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=300)
        self._reader.join(60)
        if self._log is not None:
            self._log.close()
        self.stderr = "".join(self.lines)
        try:
            return json.loads(self.summary.read_text())
        except (OSError, ValueError):
            return {}


# ---- windows and statistics ------------------------------------------------------------


MODES = {  # name -> control commands that set it up from "full" (the default tracing)
    "untraced": ["pause"],
    "full": [],
    "no-payload": ["capture-limit 1"],  # socket probes without their payload copies
    "no-analysis": ["analysis off"],  # the agent reads the records and drops them
    "no-launch-probes": ["gpu-launch off"],  # the kernel-launch uprobes out
    # every uprobe out (GPU, TLS), the socket and TCP probes in: what a duty cycle of
    # all the GPU probes could get down to at most
    "sockets-only": ["uprobes off"],
    # the socket-level timing (bpf/netwait.c) out: spans keep syscall times, as with
    # --net-timing syscall (but for a missed hash lookup in each traced socket syscall)
    "net-syscall": ["net-timing syscall"],
    "burst-min-1ms": ["burst-min-us 1000"],  # a burst record per ms, not per sync
    "stub-naming-open": ["stub-naming on"],  # the runtime's launch probes in (at attach)
    # the probes on cuKernelGetFunction in (at attach; detached once quiet)
    "alias-lookups-open": ["alias-lookups on"],
    # full, with the kernel's per-program run counts and run time on (two clock reads
    # a run more): what each probe fires per second and costs inside BPF
    "census": ["probe-stats on"],
    # --gpu-sample F (--sample-fraction) switched on while running: the cheaper mode
    "sampled": ["gpu-sample 0.1"],
    # the same with the launch probes on 0.5 s of every 5 s (--gpu-sample auto's period
    # where --gpu-sample-period is left at its default)
    "sampled-p5": ["gpu-sample 0.1 5"],
    # "sampled" with the sampled copies' probes switched with the launch probes
    # (as --gpu-sample auto does where a thread's steps are told apart without them)
    "sampled-copies": ["gpu-sample 0.1 copies"],
    # "sampled-copies" with the memsets' probes switched too (--gpu-sample auto keeps
    # them counted where their bytes are not predicted to 1% of the bytes moved): what
    # the memsets' traps cost, against "sampled-copies" in the same rounds
    "sampled-memsets": ["gpu-sample 0.1 copies memsets"],
    # --gpu-sample-period 2 / 4 set while running: --gpu-sample auto keeps its window
    # (20 or 30 ms) and opens it every 2 or 4 s, half or a quarter of the launch traps
    "period-2": ["sample-period 2"],
    "period-4": ["sample-period 4"],
    # census at period-2: what each probe fires per token with the windows half as often
    "census-period-2": ["probe-stats on", "sample-period 2"],
    # run --duty-cycle (tracer/duty.py): every probe in for 0.2 (0.5) of each 10 s, on
    # the agent's own phase, so the slices fall at every phase of the cycle alike
    "duty-0.2": ["duty-cycle 0.2/10"],
    "duty-0.5": ["duty-cycle 0.5/10"],
    # no probe of ours, only a do-nothing syscall tracepoint held by the bench: what the
    # kernel's syscall slow path (on while any syscall tracepoint is) costs the server
    "slow-path": ["pause", "bench:slow-path on"],
    # no probe of ours, a load of --agent-load cores on the agent's CPUs instead
    # (bench/host_speed.py): whether a busy agent slows the servers beside it
    "agent-load": ["pause", "bench:agent-load on"],
}
UNDO = {"untraced": ["resume"], "full": [], "no-payload": ["capture-limit 262144"],
        "no-analysis": ["analysis on"], "no-launch-probes": ["gpu-launch on"],
        "sockets-only": ["uprobes on"], "net-syscall": ["net-timing socket"],
        "burst-min-1ms": ["burst-min-us 0"], "stub-naming-open": ["stub-naming off"],
        "alias-lookups-open": ["alias-lookups off"],
        "census": ["probe-stats off"], "sampled": ["gpu-sample 1"],
        "sampled-p5": ["gpu-sample 1"], "sampled-copies": ["gpu-sample 1"],
        "sampled-memsets": ["gpu-sample 1"],
        "period-2": ["sample-period default"], "period-4": ["sample-period default"],
        "census-period-2": ["probe-stats off", "sample-period default"],
        "duty-0.2": ["duty-cycle off"], "duty-0.5": ["duty-cycle off"],
        "slow-path": ["bench:slow-path off", "resume"],
        "agent-load": ["bench:agent-load off", "resume"]}
# the bench's own switches ("bench:NAME on|off": slow-path, agent-load), set up by
# run_server for the modes it runs
BENCH_SWITCHES: dict[str, Any] = {}


def t975(df: int) -> float:
    """The t distribution's 97.5% point (Cornish-Fisher; within 0.5% for df >= 3)."""
    z = 1.959964
    if df <= 0:
        return float("inf")
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3


def mean_half_width(xs: Sequence[float]) -> tuple[float, float | None]:
    """Mean of ``xs`` and the half-width of its 95% t-interval (None below two values)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, None
    return m, t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def ratio_ci(ratios: list[float]) -> dict[str, Any]:
    """Geometric mean of per-pair ratios and its 95% interval (t over log ratios);
    ``sd_log``: the per-pair noise, the standard deviation of the log ratios."""
    logs = [math.log(r) for r in ratios if r > 0]
    n = len(logs)
    if n < 2:
        return {"pairs": n, "ratio": ratios[0] if ratios else None, "ci95": None}
    m, sd = statistics.fmean(logs), statistics.stdev(logs)
    h = t975(n - 1) * sd / math.sqrt(n)
    return {"pairs": n, "ratio": round(math.exp(m), 4),
            "ci95": [round(math.exp(m - h), 4), round(math.exp(m + h), 4)],
            "half_width": round(math.exp(h) - 1, 4), "sd_log": round(sd, 4)}


Pair = tuple[int, int, float]  # (round, replica, ratio traced / untraced)


def round_means(values: list[tuple[int, float]]) -> list[float]:
    """Per round (in the order rounds first appear), the mean of its values: one per
    replica's pair."""
    by_round: dict[int, list[float]] = {}
    for rnd, v in values:
        by_round.setdefault(rnd, []).append(v)
    return [statistics.fmean(vs) for vs in by_round.values()]


def replica_correlation(pairs: list[tuple[int, int, float]]) -> float | None:
    """The mean, over every two replicas, of the Pearson correlation of their log
    ratios across the rounds both have (3 at least); None for one replica, or where no
    two replicas vary over 3 common rounds."""
    per: dict[int, dict[int, float]] = {}
    for rnd, rep, x in pairs:
        per.setdefault(rep, {})[rnd] = x
    rs = []
    for a, b in itertools.combinations(sorted(per), 2):
        common = [k for k in per[a] if k in per[b]]
        xa, xb = [per[a][k] for k in common], [per[b][k] for k in common]
        if len(common) >= 3 and statistics.pstdev(xa) > 0 and statistics.pstdev(xb) > 0:
            rs.append(statistics.correlation(xa, xb))
    return round(statistics.fmean(rs), 3) if rs else None


def clustered_ci(pairs: list[Pair]) -> dict[str, Any]:
    """Geometric mean ratio and its 95% interval over ROUNDS: per round the mean of its
    replicas' log ratios, a t-interval over those means. The replicas of a round share
    its switch moments and the agent, so their pairs are not independent; the rounds
    are (a cluster-robust interval: its width follows the noise of a round's mean,
    whatever the replicas' correlation; perfectly correlated replicas give one
    replica's interval, independent ones one sqrt(replicas) narrower). With one replica
    exactly ``ratio_ci``. ``sd_log``: the per-pair noise, pooled over every pair;
    ``sd_log_round_mean``: the noise of a round's mean, what the interval and the rounds
    a target needs follow; ``replica_correlation``; ``effective_pairs``: the independent
    pairs the run was worth, (sd_log / sd_log_round_mean)^2 * rounds."""
    logs = [(rnd, rep, math.log(r)) for rnd, rep, r in pairs if r > 0]
    n = len(logs)
    if n < 2:
        return {"pairs": n, "ratio": pairs[0][2] if pairs else None, "ci95": None}
    means = round_means([(rnd, x) for rnd, _, x in logs])
    k, sd = len(means), statistics.stdev(x for _, _, x in logs)
    m = statistics.fmean(means)
    out: dict[str, Any] = {"pairs": n, "ratio": round(math.exp(m), 4), "ci95": None}
    if k >= 2:
        sd_r = statistics.stdev(means)
        h = t975(k - 1) * sd_r / math.sqrt(k)
        out.update(ci95=[round(math.exp(m - h), 4), round(math.exp(m + h), 4)],
                   half_width=round(math.exp(h) - 1, 4))
    out["sd_log"] = round(sd, 4)
    out["rounds"] = k
    out["replicas"] = len({rep for _, rep, _ in logs})
    if k >= 2:
        out["sd_log_round_mean"] = round(sd_r, 4)
        out["effective_pairs"] = round((sd / sd_r) ** 2 * k, 1) if sd_r > 0 else None
    out["replica_correlation"] = replica_correlation(logs)
    return out


def clustered_mean(values: list[tuple[int, float]]) -> dict[str, Any] | None:
    """Mean and 95% interval of a difference measured per pair: the t-interval over the
    rounds' means (as ``clustered_ci``, on a linear scale); None below 2 rounds."""
    means = round_means(values)
    k = len(means)
    if k < 2:
        return None
    mean, hw = mean_half_width(means)
    assert hw is not None
    return {"pairs": len(values), "rounds": k, "mean": round(mean, 4),
            "ci95": [round(mean - hw, 4), round(mean + hw, 4)]}


def add_targets(stat: dict[str, Any], target: float, seconds_per_round: float | None) -> None:
    """The rounds (and the pairs and seconds they take) a ``target`` interval needs at
    the noise of a round's mean (one replica: the per-pair noise, as ever)."""
    sd = stat.get("sd_log_round_mean") if "rounds" in stat else stat.get("sd_log")
    if not sd:
        return
    k = pairs_for(sd, target)
    per_round = stat["pairs"] / stat.get("rounds", stat["pairs"])
    stat["rounds_for_target"] = k
    stat["pairs_for_target"] = math.ceil(k * per_round - 1e-9)
    if seconds_per_round:
        stat["seconds_for_target"] = round(k * seconds_per_round)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


SlicePair = tuple[dict[str, Any], dict[str, Any]]  # (traced, untraced) slice records


def ttft_ratios(rounds: list[list[SlicePair]], q: float, rng: random.Random,
                draws: int = 400,
                ttfts: Callable[[dict[str, Any]], list[float]] = lambda w: w["ttft_ms"]
                ) -> dict[str, Any]:
    """Pooled TTFT quantile ``q`` traced / untraced, and a 95% interval from resampling
    whole rounds (each with all its replicas' pairs: they are not independent; one
    replica: resampling the pairs). ``ttfts``: a slice's TTFTs (e.g. ``unstalled``)."""
    def ratio(sample: list[list[SlicePair]]) -> float | None:
        t = [x for rnd in sample for tr, _ in rnd for x in ttfts(tr)]
        u = [x for rnd in sample for _, un in rnd for x in ttfts(un)]
        a, b = pct(t, q), pct(u, q)
        return a / b if a and b else None

    point = ratio(rounds)
    boot = sorted(r for r in (ratio([rng.choice(rounds) for _ in rounds])
                              for _ in range(draws)) if r is not None)
    ci = [round(pct(boot, 0.025), 4), round(pct(boot, 0.975), 4)] if boot else None
    return {"ratio": round(point, 4) if point else None, "ci95": ci}


def unstalled(w: dict[str, Any]) -> list[float]:
    """A slice's TTFTs but those of requests that waited through a stall of the whole
    server (``server_stalls``)."""
    left = Counter(w.get("ttft_stalled_ms", ()))
    out = []
    for x in w["ttft_ms"]:
        if left[x]:
            left[x] -= 1
        else:
            out.append(x)
    return out


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95% interval of a proportion k / n."""
    p = k / n
    mid, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (mid - half) / (1 + z * z / n), (mid + half) / (1 + z * z / n)


def stall_rates(windows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The server's stalls (``server_stalls``) by mode: how many, in how many seconds
    of slices, how long; and full against untraced, the ratio of their rates with a
    95% interval (Wilson's, of full's share of both modes' stalls, given their
    seconds). A tracer that made a server stall more often shows here, whatever the
    TTFT quantiles outside stalls say."""
    windows = [w for w in windows if "stalls" in w]  # older records have none
    if not windows:
        return None
    by: dict[str, dict[str, Any]] = {}
    for w in windows:
        m = by.setdefault(w["mode"], {"stalls": 0, "slice_s": 0.0, "stall_s": 0.0,
                                      "requests_stalled": 0})
        m["stalls"] += len(w["stalls"])
        m["slice_s"] += w["wall_s"]
        m["stall_s"] += sum(d for _, d in w["stalls"])
        m["requests_stalled"] += len(w.get("ttft_stalled_ms", ()))
    for m in by.values():
        m["per_minute"] = round(60 * m["stalls"] / m["slice_s"], 3) if m["slice_s"] else None
        m["slice_s"], m["stall_s"] = round(m["slice_s"], 1), round(m["stall_s"], 3)
    out: dict[str, Any] = {"by_mode": by}
    f, u = by.get("full"), by.get("untraced")
    if f and u and f["stalls"] + u["stalls"] and u["stalls"] and f["slice_s"] and u["slice_s"]:
        n, exposure = f["stalls"] + u["stalls"], u["slice_s"] / f["slice_s"]
        lo, hi = wilson(f["stalls"], n)
        out["full_over_untraced"] = {
            "ratio": round(f["stalls"] / u["stalls"] * exposure, 3),
            "ci95": [round(lo / (1 - lo) * exposure, 3),
                     round(hi / (1 - hi) * exposure, 3) if hi < 1 else None]}
    return out


@dataclass
class Lane:
    """One replica: its server, its load generator and its GPU (``CUDA_VISIBLE_DEVICES``
    entry; None: not set)."""

    replica: int
    server: Server
    client: Client | None = None
    gpu: str | None = None

    @property
    def nvml_index(self) -> int | None:
        """Its GPU's NVML index, for the clock sampler: 0 where ``CUDA_VISIBLE_DEVICES``
        is left alone (one replica, as ever), none for a GPU named by UUID."""
        if self.gpu is None:
            return 0
        return int(self.gpu) if self.gpu.isdigit() else None


def cb_memory_args(gpu_sharers: int) -> list[str]:
    """HF serve CB's options for one of ``gpu_sharers`` servers on one GPU. Its KV cache
    is sized at 0.9 of the GPU's memory less what its own process holds (transformers
    5.17 on the H200 hosts, 5.24 here: ``total - max(allocated, reserved)`` from torch's
    own counters, not the device's free memory), so two servers on one GPU each size
    theirs for the whole GPU. Two of three calls on 2026-11-29 and two of three on
    2026-12-02 had one of the two answer 503 (transformers' "CB worker dead") to every
    request, the bench's restart of it no help this time (it was, once, before). The
    second cache not fitting is a likely cause, not yet seen in a log: the bench
    printed only the log's tail, now its errors too. Each server is given its share of
    0.8 instead."""
    if gpu_sharers <= 1:
        return []
    return ["--cb-max-memory-percent", f"{0.8 / gpu_sharers:.3f}"]


def start_lanes(kind: str, args: argparse.Namespace, work: Path, plan: CpuPlan,
                gpus: list[str | None], lanes: list[Lane]) -> None:
    """Start every replica's server (all at once, then wait for each), each in its own
    work directory (``work/replica-i``) with its own port and CPUs, on CUDA with its own
    GPU where there are several replicas; HF kinds serve one tiny Llama built once.
    ``lanes`` is filled as they start, so that a failure stops those started."""
    model = (tiny_llama(work, args.keep_eos, args.model_shape)
             if kind in ("hf-cb", "hf-plain") else None)
    sharers = Counter(gpus[:len(plan.lanes)])
    for i, cpus in enumerate(plan.lanes):
        rwork = work / f"replica-{i}"
        rwork.mkdir()
        env = None
        if len(plan.lanes) > 1 and gpus[i] is not None:  # NVML's order, for its clocks
            env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(gpus[i])}
        server = Server(kind, args.device, rwork, cpus["server"], keep_eos=args.keep_eos,
                        env=env, model=model, wait=False,
                        gpu_sharers=sharers[gpus[i]] if gpus[i] is not None else 1)
        lanes.append(Lane(i, server, gpu=gpus[i]))
    for lane in lanes:
        lane.server.ready()


def start_loads(lanes: list[Lane], args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Every replica's continuous load (``--mode slices``), until tokens flow from each
    (``first_tokens_after_s``: the last replica's; per replica as well where several),
    then ``--warmup-s`` of it."""
    t0 = time.monotonic()
    for lane in lanes:
        assert lane.client is not None
        lane.client.ask("start")
    firsts, restarted = [], []
    for lane in lanes:
        assert lane.client is not None
        try:
            firsts.append(lane.client.first_tokens(args.first_tokens_s, since=t0))
            continue
        except RuntimeError as e:
            why = e
        # HF serve CB stalled before its first token in two of three runs with two
        # replicas on a GPU (H200 hosts, 2026-11-29; the agent not yet started): a
        # replica whose tokens do not come is started once more, and the run says so
        log = lane.server.log.read_text(errors="replace")
        errors = [line for line in log.splitlines()
                  if any(w in line for w in ("Error", "error", "out of memory", "Traceback"))
                  and " 503 " not in line]
        print(f"replica {lane.replica}: {why}; its server's log's errors:\n"
              + "\n".join(errors[:20]) + f"\nand its end:\n{log[-1500:]}\nrestarting it",
              file=sys.stderr, flush=True)
        lane.client.close()
        lane.server.restart()
        lane.server.ready()
        lane.client = Client(lane.server, args, lane.client.cpus)
        lane.client.ask("start")
        firsts.append(lane.client.first_tokens(args.first_tokens_s))
        restarted.append(lane.replica)
    out["replicas_restarted"] = restarted
    out["first_tokens_after_s"] = max(firsts)
    if len(firsts) > 1:
        out["first_tokens_after_s_per_replica"] = firsts
    time.sleep(args.warmup_s)  # the same, under the load the slices measure


def stop_loads(lanes: list[Lane], out: dict[str, Any]) -> None:
    """Stop every replica's load: each client's totals (``load_per_replica``) and their
    sum (``load``; one replica: its own)."""
    replies = [lane.client.ask("stop") for lane in lanes if lane.client is not None]
    out["load_per_replica"] = replies
    total: dict[str, Any] = {}
    for reply in replies:
        for k, v in reply.items():
            total[k] = total.get(k, 0) + v if isinstance(v, (int, float)) else v
    out["load"] = replies[0] if len(replies) == 1 else total


def window_record(args: argparse.Namespace, name: str) -> list[str]:
    """``--window-log DIR``: the agent's own capture (``--record``), whose
    ``GpuSampling`` switches say when its launch probes went in and out."""
    if not args.window_log:
        return []
    return ["--record", str(Path(args.window_log) / f"agent{name}.ttcap")]


def dump_loads(lanes: list[Lane], args: argparse.Namespace) -> None:
    """``--window-log DIR``: each replica's token and request times (``Load.dump``)."""
    if not args.window_log:
        return
    for lane in lanes:
        if lane.client is not None:
            lane.client.ask(f"dump {Path(args.window_log) / f'client-{lane.replica}.json'}")


def log_slices(args: argparse.Namespace, slices: Records) -> None:
    """``--window-log DIR``: each slice's replica, mode and span in monotonic seconds
    (the result's ``t0`` are from the first slice's), and each replica's agent."""
    if not args.window_log:
        return
    rows = [{k: w[k] for k in ("replica", "mode", "round", "t0", "wall_s")} for w in slices]
    crossover = args.design == "crossover"
    doc = {"slices": rows, "agent_of_replica": {str(i): f"agent-{i % 2}" if crossover
                                                else "agent" for i in range(args.replicas)}}
    Path(args.window_log, "slices.json").write_text(json.dumps(doc) + "\n")


def is_census(mode: str) -> bool:
    """Whether slices of ``mode`` take the kernel's per-program statistics."""
    return mode == "census" or mode.startswith("census-")


def choose_modes(args: argparse.Namespace, gpu: bool) -> list[str]:
    """Untraced and full, and with ``--breakdown`` the parts this server has."""
    modes = ["untraced", "full"]
    if args.breakdown:
        parts = ["no-payload", "no-analysis", "net-syscall", "census", "slow-path",
                 "agent-load", "duty-0.2", "duty-0.5"]
        if gpu:
            parts += ["no-launch-probes", "sockets-only", "burst-min-1ms", "stub-naming-open",
                      "alias-lookups-open", "sampled", "sampled-p5", "sampled-copies",
                      "sampled-memsets", "period-2", "period-4", "census-period-2"]
            MODES["sampled"] = [f"gpu-sample {args.sample_fraction:g}"
                                + (f" {args.sample_period:g}" if args.sample_period else "")]
            MODES["sampled-p5"] = [f"gpu-sample {args.sample_fraction:g} 5"]
            MODES["sampled-copies"] = [MODES["sampled"][0] + " copies"]
            MODES["sampled-memsets"] = [MODES["sampled"][0] + " copies memsets"]
        wanted = args.breakdown_modes.split(",") if args.breakdown_modes else parts
        modes += [m for m in parts if m in wanted]
    return modes


def run_server(kind: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One kind of server, ``--replicas`` of it, traced by one agent: the run's result."""
    n = args.replicas
    plan = plan_lanes(n, args.agent_cpus)
    if args.server_cpus:
        plan.narrow_servers(args.server_cpus)
    gpus = replica_gpus(n, args.device)
    on_gpus = Counter(g for g in gpus if g is not None)
    lanes: list[Lane] = []
    agent = watch = meters = load = None
    own_cpus = os.sched_getaffinity(0)
    agents: list[Agent] = []
    crossover = args.design == "crossover"
    out: dict[str, Any] = {"server": kind, "device": args.device, "mode": args.mode,
                           "design": args.design, "replicas": n,
                           "replicas_per_gpu": max(on_gpus.values()) if on_gpus else None,
                           "gpus": gpus if args.device == "cuda" else None,
                           "cpus": plan.as_json(), "cpus_shared": plan.shared,
                           "requests_in_mix" if args.mode == "slices" else
                           "requests_per_window": args.requests,
                           "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                           "fixed_work": not args.keep_eos and kind in ("hf-cb", "hf-plain")}
    mode_s: dict[str, float] = {}
    halves_s: list[dict[str, float]] = []  # crossover: each agent's
    loaded = False
    try:
        start_lanes(kind, args, work, plan, gpus, lanes)
        for lane in lanes:
            lane.client = Client(lane.server, args, plan.lanes[lane.replica]["client"])
        if args.mode == "windows":
            assert lanes[0].client is not None
            for _ in range(args.warmup):
                lanes[0].client.window()  # the engine built, kernels loaded, caches warm
        else:
            loaded = True
            start_loads(lanes, args, out)
        if crossover:  # an agent per half of the replicas
            for g in (0, 1):
                agents.append(Agent([lane.server for lane in lanes[g::2]], work, plan.agent,
                                    args.agent_args.split() + window_record(args, f"-{g}"),
                                    name=f"-{g}"))
            agent = agents[0]
        else:
            agent = Agent([lane.server for lane in lanes], work, plan.agent,
                          args.agent_args.split() + window_record(args, ""))
            agents.append(agent)
        t_attached = time.monotonic()
        # the bench's own work between slices (the clients' slices asked, the progress,
        # the switches) beside the agent, off the servers' and clients' CPUs
        os.sched_setaffinity(0, plan.agent)
        for lane in lanes:  # threads the servers started since
            pin(lane.server.pid, plan.lanes[lane.replica]["server"])
        gpu = int(agent.ctl("status").rsplit("gpu_libs=", 1)[1].split()[0]) > 0
        if gpu:  # the window kernel naming opens at attach closes by itself once naming
            for a in agents:  # is quiet: closed now, "full" is the steady state, and the
                a.ctl("stub-naming off")  # window's cost a mode of its own
        # --agent-ctl: the agents set as asked before the first slice (both still tracing)
        out["agent_ctl"] = [[a.ctl(cmd).strip() for a in agents] for cmd in args.agent_ctl]
        modes = choose_modes(args, gpu)
        if crossover:
            modes += [m for v in args.variants for m in (v, baseline_of(v))]
            modes += [NONE_TRACED] if args.null_every else []
        if args.speed_meter:
            meters = start_meters(work, plan)
        if "agent-load" in modes:
            from bench.host_speed import AgentLoad
            load = AgentLoad(plan.agent, args.agent_load)
            BENCH_SWITCHES["agent-load"] = load.set
        if "slow-path" in modes or any(is_census(m) for m in modes):
            from bench.syscall_watch import SyscallWatch
            watch = SyscallWatch()
            BENCH_SWITCHES["slow-path"] = watch.slow_path
        if args.mode == "windows":
            assert lanes[0].client is not None
            windows, switches, elapsed = run_windows(kind, agent, lanes[0].client,
                                                     lanes[0].server, args, modes)
        elif crossover:
            windows, switches, elapsed, halves_s = run_crossover(kind, agents, lanes, args,
                                                                 modes)
            stop_loads(lanes, out)
            dump_loads(lanes, args)
            loaded = False
            for h in halves_s:
                h["all"] = time.monotonic() - t_attached
        else:
            windows, switches, elapsed, mode_s = run_slices(kind, agent, lanes, args, modes,
                                                            watch, meters)
            stop_loads(lanes, out)
            dump_loads(lanes, args)
            loaded = False
            mode_s["all"] = time.monotonic() - t_attached
        stats = summarise(windows, modes)
        out.update(stats)
        rounds = max((w["round"] for w in windows), default=0)
        out["seconds_per_pair"] = round(elapsed / max(1, rounds * n), 2)
        out["seconds_per_round"] = round(elapsed / max(1, rounds), 2)
        for key in ("tokens_per_s", "server_cpu_per_token"):
            add_targets(stats[key], args.target, elapsed / max(1, rounds))
        out["windows" if args.mode == "windows" else "slices"] = windows
        out["switch_s"] = {"max": max(switches, default=0.0),
                           "mean": round(statistics.fmean(switches), 4) if switches else 0.0,
                           "n": len(switches)}
    finally:
        if loaded:
            try:
                stop_loads(lanes, out)
            except (RuntimeError, OSError, ValueError):
                pass
        if watch is not None:
            watch.close()
        if meters is not None:
            meters.close()
        if load is not None:
            load.close()
        BENCH_SWITCHES.clear()
        os.sched_setaffinity(0, own_cpus)
        summaries = [a.stop() for a in agents]
        for lane in lanes:
            if lane.client is not None:
                lane.client.close()
            lane.server.stop()
    out["agent_report_tail"] = agent.stderr.strip().splitlines()[-3:] if agent else []
    if not crossover:
        out["agent"] = agent_stats(out, summaries[0] if summaries else {}, mode_s, args.mode)
        return out
    # each half's agent over its own replicas' slices
    ws = out.get("slices", [])
    out["agents"] = [agent_stats({"slices": [w for w in ws if w["replica"] % 2 == g]},
                                 summaries[g] if g < len(summaries) else {},
                                 halves_s[g] if g < len(halves_s) else {}, args.mode)
                     for g in (0, 1)]
    out["agent"] = out["agents"][0]
    return out


def agent_stats(out: dict[str, Any], summary: dict[str, Any], mode_s: dict[str, float],
                mode: str) -> dict[str, Any]:
    """The agent's CPU per 1k requests and per 1M launches over the traced slices
    (windows), its records per second, its report. The agent's CPU and records are
    split among a time slice's replicas: summed over the records they are the agent's;
    time is counted once per time slice (replica 0's records)."""
    launches = sum(p.get("kernel_launches", 0) for p in summary.get("gpu", {}).get("processes", []))
    ws = out.get("windows", out.get("slices", []))
    # windows: every traced window; slices: the fully traced ones
    traced = [w for w in ws if (w["mode"] == "full" if mode == "slices"
                                else w["mode"] != "untraced")]
    cpu_traced = sum(w["agent_cpu_s"] for w in traced)
    first = min((w.get("replica", 0) for w in ws), default=0)  # a crossover half's own
    traced_s = sum(w["wall_s"] for w in traced if w.get("replica", 0) == first)
    if mode == "slices" and launches:
        # launches are counted over the whole run: their rate over the time the launch
        # probes were in, times the traced slices' time
        probed_s = mode_s.get("all", 0.0) - mode_s.get("untraced", 0.0) \
            - mode_s.get("no-launch-probes", 0.0)
        launches_in = launches * traced_s / probed_s if probed_s > 0 else 0
    else:
        launches_in = launches
    stats = {
        "cpu_per_1k_requests_s": round(1000 * cpu_traced / max(1, sum(w["requests"] for w in traced)), 4),
        "cpu_per_1m_launches_s": round(1e6 * cpu_traced / launches_in, 3) if launches_in else None,
        "launches_traced": launches,
        "cpu_untraced_windows_s": round(sum(w["agent_cpu_s"] for w in ws
                                            if w["mode"] == "untraced"), 3),
        "records_per_s": round(sum(w["agent_records"] for w in traced) / max(1e-9, traced_s), 1),
        "report": summary.get("report", {}),
        # launched handles and launches by where their names came from
        "kernel_names": [p.get("kernel_names") for p in
                         summary.get("gpu", {}).get("processes", []) if p.get("kernel_launches")],
        # what --gpu-sample auto chose, and why (what is switched with the launches)
        "launch_sampling": summary.get("gpu", {}).get("launch_sampling"),
    }
    if mode_s:
        stats["seconds_in_mode"] = {k: round(v, 1) for k, v in mode_s.items()}
    return stats


def pairs_for(sd: float, target: float) -> int:
    """Pairs whose 95% interval (t over log ratios of standard deviation ``sd``) is
    within ``target`` either side."""
    goal = math.log(1 + target)
    n = max(2, math.ceil((1.96 * sd / goal) ** 2))
    while t975(n - 1) * sd / math.sqrt(n) > goal:
        n += 1
    return n


def progress(kind: str, order: int, elapsed: float, stats: dict[str, Any]) -> None:
    tp, cp = stats["tokens_per_s"], stats["server_cpu_per_token"]
    several = (tp.get("replicas") or 1) > 1
    extra = (f" [{tp.get('pairs')} pairs; sd of a round's mean {tp.get('sd_log_round_mean')}, "
             f"replica correlation {tp.get('replica_correlation')}, effective pairs "
             f"{tp.get('effective_pairs')}]") if several else ""
    print(f"{kind}: round {order}, {elapsed:.0f}s: tokens/s ratio {tp.get('ratio')} "
          f"+-{tp.get('half_width')} (sd {tp.get('sd_log')}); server CPU/token ratio "
          f"{cp.get('ratio')} +-{cp.get('half_width')} (sd {cp.get('sd_log')}){extra}",
          file=sys.stderr, flush=True)


def switch_time(reply: str, cmd: str, switches: list[float]) -> None:
    """The seconds a pause or resume took, from the agent's ``ok paused|resumed 0.123s``
    (a resume outside a duty cycle's window adds when the next one opens)."""
    if cmd in ("pause", "resume"):
        switches.append(float(reply.split()[2].rstrip("s")))


def command(agent: Agent, cmd: str) -> str:
    """A mode's switch: ``bench:...`` for the bench's own (``BENCH_SWITCHES``: the
    ``SyscallWatch``'s probe, the agent-load), anything else for the agent."""
    if cmd.startswith("bench:"):
        what, state = cmd[len("bench:"):].split()
        if what not in BENCH_SWITCHES:
            raise RuntimeError(f"{cmd}: no such bench switch")
        BENCH_SWITCHES[what](state == "on")
        return "ok"
    return agent.ctl(cmd)


def run_windows(kind: str, agent: Agent, client: Client, server: Server,
                args: argparse.Namespace, modes: list[str]
                ) -> tuple[list[dict[str, Any]], list[float], float]:
    """``--mode windows``: the whole mix per window, untraced and full in ABBA order,
    each mode set up before its window and undone after it."""
    windows: list[dict[str, Any]] = []
    switches: list[float] = []
    t_start = time.monotonic()
    order = 0
    while True:
        # one round: untraced and full in alternating order (ABBA), the parts after
        rnd = ["untraced", "full"] if order % 2 == 0 else ["full", "untraced"]
        if order % args.breakdown_every == 0:
            rnd += [m for m in modes if m not in ("untraced", "full")]
        order += 1
        for mode in rnd:
            for cmd in MODES[mode]:
                switch_time(command(agent, cmd), cmd, switches)
            time.sleep(args.settle_s)
            a0, s0, r0 = agent.cpu, tree_cpu(server.pid), agent.records()
            w = client.window()
            w.update(mode=mode, round=order, agent_cpu_s=agent.cpu - a0,
                     server_cpu_s=tree_cpu(server.pid) - s0,
                     agent_records=agent.records() - r0)
            windows.append(w)
            for cmd in UNDO[mode]:
                switch_time(command(agent, cmd), cmd, switches)
        stats = headline(windows)
        elapsed = time.monotonic() - t_start
        progress(kind, order, elapsed, stats)
        hw = stats["tokens_per_s"].get("half_width")
        per_round = elapsed / order
        if order >= args.min_pairs and hw is not None and hw <= args.target:
            break
        if order >= args.max_pairs or elapsed + per_round > args.budget_s:
            break
    return windows, switches, time.monotonic() - t_start


def gpu_clocks(lanes: list[Lane]) -> dict[int, GpuClocks]:
    """A clock sampler for each GPU the replicas use (by NVML index); none without
    NVML."""
    clocks: dict[int, GpuClocks] = {}
    for lane in lanes:
        index = lane.nvml_index
        if index is None or index in clocks:
            continue
        try:
            clocks[index] = GpuClocks(index)
        except Exception as e:  # noqa: BLE001 (a diagnostic only: no NVML, no clocks)
            print(f"no GPU clocks: {e!r}", file=sys.stderr)
            break
    return clocks


def time_slice(mode: str | Sequence[str], order: int, agent: Agent | Sequence[Agent],
               lanes: list[Lane], slice_s: float, watch: Any = None,
               clocks: dict[int, GpuClocks] | None = None,
               meters: Any = None) -> list[dict[str, Any]]:
    """One time slice of ``mode``: a record per replica (``replica``) with its server's
    CPU, system CPU and busiest threads, its client's CPU (its tokens and requests are
    asked later, ``run_slices``), its GPU's clocks. The agent serves every replica: its
    CPU and records in the time slice are split evenly among the replicas' records, so
    that sums over records stay the agent's. Census mode's per-program counts and the
    servers' syscalls (agent-wide; the union of every server's processes) go on replica
    0's record only. ``--design crossover`` passes a mode per lane and two agents,
    lane i's being ``agent[i % 2]``: each agent's CPU and records are split among its
    own lanes."""
    agents = [agent] if isinstance(agent, Agent) else list(agent)
    modes = [mode] * len(lanes) if isinstance(mode, str) else list(mode)
    census = any(is_census(m) for m in modes)
    if census and len(agents) > 1:
        raise ValueError("census needs the one agent of every replica")
    mine = [agents[i % len(agents)] for i in range(len(lanes))]
    share = Counter(id(a) for a in mine)  # lanes per agent
    th0 = [thread_cpu(lane.server.pid) for lane in lanes]
    p0 = agents[0].ctl("probe-stats") if census else ""
    if census and watch is not None:  # the servers' syscalls, by name
        watch.count_start({p for lane in lanes for p in tree(lane.server.pid)})
    s0 = [tree_times(lane.server.pid) for lane in lanes]
    q0 = [sched_stats(lane.server.pid) for lane in lanes]
    a0 = {id(a): (a.cpu, a.records()) for a in agents}
    c0 = [lane_cpu(lane) for lane in lanes]
    m0 = meters.read() if meters is not None else {}
    t0 = time.monotonic()
    time.sleep(slice_s)
    t1 = time.monotonic()
    m1 = meters.read() if meters is not None else {}
    s1 = [tree_times(lane.server.pid) for lane in lanes]
    q1 = [sched_stats(lane.server.pid) for lane in lanes]
    a1 = {id(a): (a.cpu, a.records()) for a in agents}
    c1 = [lane_cpu(lane) for lane in lanes]
    p1 = agents[0].ctl("probe-stats") if census else ""
    calls = watch.count_stop() if census and watch is not None else None
    th1 = [thread_cpu(lane.server.pid) for lane in lanes]
    records = []
    for i, lane in enumerate(lanes):
        busy = sorted((v - th0[i].get(k, 0.0) for k, v in th1[i].items()), reverse=True)
        a, n = id(mine[i]), share[id(mine[i])]
        w: dict[str, Any] = {
            "mode": modes[i], "round": order, "replica": lane.replica, "t0": t0,
            "wall_s": t1 - t0, "server_cpu_s": s1[i][0] - s0[i][0],
            "agent_cpu_s": (a1[a][0] - a0[a][0]) / n, "client_cpu_s": c1[i] - c0[i],
            "agent_records": a1[a][1] - a0[a][1] if n == 1 else (a1[a][1] - a0[a][1]) / n,
            "server_sys_s": s1[i][1] - s0[i][1],
            # the server's busiest threads (a GIL-bound server: one near 1.0/s)
            "server_top_threads_cpu_s": [round(b, 2) for b in busy[:3]],
            "server_voluntary_switches": q1[i][0] - q0[i][0],
            "server_involuntary_switches": q1[i][1] - q0[i][1],
            "server_run_delay_s": round((q1[i][2] - q0[i][2]) / 1e9, 4)}
        clock = None if lane.nvml_index is None else (clocks or {}).get(lane.nvml_index)
        if clock is not None:
            w["gpu"] = clock.mean(t0, t1)
        if m1 and i == 0:  # host-wide: once per time slice
            w["host_speed"] = {k: round((m1[k] - m0[k]) / (t1 - t0), 2) for k in m1}
        if census and i == 0:
            a, none = parse_costs(p0), ProgramCost(0, 0)
            w["programs"] = {name: [c.runs - a.get(name, none).runs,
                                    c.run_ns - a.get(name, none).run_ns]
                             for name, c in parse_costs(p1).items()}
            if calls is not None:
                w["server_syscalls"] = calls
        records.append(w)
    return records


def start_meters(work: Path, plan: CpuPlan) -> Any:
    """bench/host_speed.py's meters on the plan's unused CPUs (the last two), or none
    (said on stderr) where no CPU is unused."""
    from bench.host_speed import KINDS, SpeedMeters
    cpus = sorted(plan.unused)[-len(KINDS):]
    if not cpus or plan.shared:
        print("no unused CPU: no host speed meter", file=sys.stderr, flush=True)
        return None
    meters = SpeedMeters(work, cpus)
    meters.wait_started()
    return meters


def lane_cpu(lane: Lane) -> float:
    """A replica's client's CPU seconds."""
    return lane.client.cpu if lane.client is not None else 0.0


Records = list[dict[str, Any]]


def run_rounds(kind: str, lanes: list[Lane], args: argparse.Namespace, modes: list[str],
               switches: list[float],
               take_round: Callable[[int, dict[int, GpuClocks]], Records]
               ) -> tuple[Records, float, float]:
    """The rounds of a slices run, both designs: ``take_round(order, clocks)`` switches
    and measures round ``order``'s (1, 2, ...) time slices and returns their records.
    Slices are asked of the clients one round late, when every request sent in them has
    had its first token. Rounds go on until the tokens/s interval is within
    ``--target`` (after ``--min-pairs`` rounds), or ``--max-pairs`` or ``--budget-s``
    run out. The slices, with ``t0`` from the first one's, and the run's start and end."""
    clocks = gpu_clocks(lanes) if args.device == "cuda" else {}
    t_start = time.monotonic()
    slices: Records = []
    pending: Records = []
    order = 0
    while True:
        order += 1
        done, pending = pending, take_round(order, clocks)
        slices += pending
        fill_slices(lanes, done)
        elapsed = time.monotonic() - t_start
        if args.partial:  # what a run cut short by a time limit still leaves
            Path(args.partial).write_text(json.dumps({"server": kind, "slices": slices,
                                                      "switches": switches}) + "\n")
        complete = [w for w in slices if "tokens" in w]
        if complete:
            stats = headline(complete)
            progress(kind, order - 1, elapsed, stats)
            hw = stats["tokens_per_s"].get("half_width")  # the interval over rounds
            if order - 1 >= args.min_pairs and hw is not None and hw <= args.target:
                break
        if order >= args.max_pairs or elapsed + elapsed / order > args.budget_s:
            break
    fill_slices(lanes, pending)
    for clock in clocks.values():
        clock.running = False
    log_slices(args, slices)
    t0 = slices[0]["t0"] if slices else t_start
    for w in slices:
        w["t0"] = round(w["t0"] - t0, 3)
    return slices, t_start, time.monotonic()


def fill_slices(lanes: list[Lane], todo: Records) -> None:
    """Each slice record's tokens, requests and TTFTs, asked of its replica's client."""
    for w in todo:
        client = lanes[w["replica"]].client
        assert client is not None
        w.update(client.slice(w["t0"], w["t0"] + w["wall_s"]))


def run_slices(kind: str, agent: Agent, lanes: list[Lane], args: argparse.Namespace,
               modes: list[str], watch: Any = None, meters: Any = None
               ) -> tuple[Records, list[float], float, dict[str, float]]:
    """``--mode slices``: under continuous load, slices of ``--slice-s`` in the order
    U T T U U T ... (a round is one untraced and one traced slice, their order
    alternating), the parts' slices after a round's pair every ``--breakdown-every``
    rounds. The agent is switched only where the mode changes; ``--settle-s`` after
    each switch. Every time slice measures every replica (``time_slice``); the rounds
    are ``run_rounds``'."""
    switches: list[float] = []
    state: list[Any] = ["full", time.monotonic()]
    mode_s: dict[str, float] = {}

    def go(mode: str) -> None:
        if mode == state[0]:
            return
        for cmd in UNDO[state[0]] + MODES[mode]:
            switch_time(command(agent, cmd), cmd, switches)
        now = time.monotonic()
        mode_s[state[0]] = mode_s.get(state[0], 0.0) + now - state[1]
        resumed = state[0] == "untraced"
        state[:] = [mode, now]
        time.sleep(args.settle_resume_s if resumed and args.settle_resume_s is not None
                   else args.settle_s)

    def take_round(order: int, clocks: dict[int, GpuClocks]) -> Records:
        rnd = ["untraced", "full"] if order % 2 == 1 else ["full", "untraced"]
        if args.breakdown and (order - 1) % args.breakdown_every == 0:
            rnd += [m for m in modes if m not in ("untraced", "full")]
        records: Records = []
        for mode in rnd:
            go(mode)
            records += time_slice(mode, order, agent, lanes, args.slice_s, watch, clocks,
                                  meters)
        return records

    slices, t_start, end = run_rounds(kind, lanes, args, modes, switches, take_round)
    mode_s[state[0]] = mode_s.get(state[0], 0.0) + end - state[1]
    go("full")  # the agent as it started, for its report
    return slices, switches, end - t_start, mode_s


NONE_TRACED = "none-traced"  # crossover's null slice: both halves untraced


def baseline_of(mode: str) -> str:
    """The untraced half's label in a crossover slice whose traced half runs ``mode``:
    ``untraced`` for ``full``, ``untraced@MODE`` for a ``--variants`` mode, so each
    traced mode is set against the untraced slices of its own moments."""
    return "untraced" if mode == "full" else f"untraced@{mode}"


def crossover_plan(order: int, variants: Sequence[str], null: int | None = None
                   ) -> list[tuple[int | None, str]]:
    """Round ``order``'s (1, 2, ...) slices in ``--design crossover``: (the half traced,
    its mode). Each traced mode (``full``, then the ``--variants``; reversed in even
    rounds) takes two slices, one half traced in each; the halves snake (0 1 | 1 0 |
    0 1 ...) over the sequence, so that the traced agent changes only within a mode's
    two slices and a mode change comes on the agent already tracing. Without variants
    that is the ABBA order (0 1 | 1 0 | ...). ``null``: a slice with neither half
    traced (``none-traced``) at that place of the round (modulo its slices + 1;
    ``null_place`` turns it through every place, the first to the last, so that what a
    slice leaves to the next weighs on the null slices as on the others)."""
    modes = ["full", *variants]
    if order % 2 == 0:
        modes.reverse()
    plan: list[tuple[int | None, str]] = []
    for k, mode in enumerate(modes):
        s = (order - 1) * len(modes) + k  # this mode's place in the whole run
        plan += [(h, mode) for h in ((0, 1) if s % 2 == 0 else (1, 0))]
    if null is not None:
        plan.insert(null % (len(plan) + 1), (None, NONE_TRACED))
    return plan


def null_place(order: int, every: int) -> int | None:
    """``--null-every N``: round ``order``'s null slice's place (``crossover_plan``),
    the k-th null round's at place k - 1; None in a round without one."""
    if not every or order % every:
        return None
    return order // every - 1


def run_crossover(kind: str, agents: list[Agent], lanes: list[Lane],
                  args: argparse.Namespace, modes: list[str]
                  ) -> tuple[Records, list[float], float, list[dict[str, float]]]:
    """``--design crossover``: two agents, each tracing half the replicas (agent g the
    lanes i with i % 2 == g); in every time slice one half is traced and the other
    untraced, the halves swapping in ABBA order (A B B A A B ...: one switch per round,
    a pause of one agent and a resume of the other, then ``--settle-resume-s``). A
    replica's round is still one traced and one untraced slice of its own, so
    ``summarise`` pairs them as ever; but its round mean now takes each half's traced
    slice against the other half's at the same moment, and what the whole host does in
    a slice (its speed drifts by ±15-20% between 3-s slices on the lent H100 hosts,
    docs/overhead.md) cancels out of it, where the alternating design leaves it in.

    ``--variants M,...``: each round also traces each half in mode M (``MODES``: a part
    of the tracer switched off while the rest traces, e.g. ``net-syscall``), the other
    half untraced (``untraced@M``) at the same moments (``crossover_plan``): each
    mode's ratio cancels the host's drift as ``full``'s does, and a mode's difference
    from ``full`` is paired by round.

    What it leaves out: the untraced half runs beside the traced half's probes, and the
    socket and TCP tracepoints are global (their programs run for every process's
    syscalls and segments, and return at once for one not traced). ``--null-every N``
    adds to every Nth round a slice with both halves untraced (``none-traced``): against
    the round's untraced slice of each replica, what that tax is (``server_sys``'s
    ``none-traced_added_per_s``: minus the system CPU it costs an untraced server).
    Per agent the seconds it spent in each mode."""
    switches: list[float] = []
    traced: list[Any] = [0, "full"]  # the half traced now and its mode (agent 1 paused)
    mode_s: list[dict[str, float]] = [{}, {}]
    since = [time.monotonic()]
    switch_time(agents[1].ctl("pause"), "pause", switches)

    def book(now: float) -> None:
        for g in (0, 1):
            m = traced[1] if g == traced[0] else "untraced"
            mode_s[g][m] = mode_s[g].get(m, 0.0) + now - since[0]

    def go(half: int | None, mode: str) -> None:
        """``half`` traced in ``mode`` and the other not; None: neither."""
        was, was_mode = traced
        if half == was and (half is None or mode == was_mode):
            return
        book(time.monotonic())
        if half is not None and half == was:  # the same agent: its mode alone
            for cmd in UNDO[was_mode] + MODES[mode]:
                switch_time(command(agents[half], cmd), cmd, switches)
            traced[1], since[0] = mode, time.monotonic()
            time.sleep(args.settle_s)
            return
        if was is not None:
            for cmd in UNDO[was_mode] + ["pause"]:
                switch_time(command(agents[was], cmd), cmd, switches)
        if half is not None:
            for cmd in ["resume"] + MODES[mode]:
                switch_time(command(agents[half], cmd), cmd, switches)
        traced[:], since[0] = [half, mode], time.monotonic()
        resumed = half is not None and args.settle_resume_s is not None
        time.sleep(args.settle_resume_s if resumed else args.settle_s)

    def take_round(order: int, clocks: dict[int, GpuClocks]) -> Records:
        records: Records = []
        for half, mode in crossover_plan(order, args.variants,
                                         null_place(order, args.null_every)):
            go(half, mode)
            lane_modes = [NONE_TRACED if half is None else mode if i % 2 == half
                          else baseline_of(mode) for i in range(len(lanes))]
            records += time_slice(lane_modes, order, agents, lanes, args.slice_s,
                                  clocks=clocks)
        return records

    slices, t_start, end = run_rounds(kind, lanes, args, modes, switches, take_round)
    book(end)
    if traced[0] is not None:
        for cmd in UNDO[traced[1]]:
            switch_time(command(agents[traced[0]], cmd), cmd, switches)
    for g in (0, 1):  # both traced, as they began
        if g != traced[0]:
            switch_time(agents[g].ctl("resume"), "resume", switches)
    return slices, switches, end - t_start, mode_s


def switch_effects(slices: list[dict[str, Any]]) -> dict[str, Any]:
    """Slices: what a switch leaves behind. The order U T T U U T ... makes every pair
    one slice right after a switch ("fresh") and one that follows a slice of its own
    mode; a transient after a resume (or a pause) shows as traced (untraced) fresh
    slices slower than the slices after them, and as a gap between the two kinds of
    pair. The pairs' mean ratio holds both kinds equally often. Sequences are per
    replica (consecutive slices of the same replica); intervals over rounds
    (``clustered_ci``)."""
    lanes: dict[int, list[dict[str, Any]]] = {}
    for w in slices:
        lanes.setdefault(w.get("replica", 0), []).append(w)
    blocks: dict[str, list[Pair]] = {"full": [], "untraced": []}
    for rep, ws in lanes.items():
        for a, b in itertools.pairwise(ws):
            if a["mode"] == b["mode"] and a["mode"] in blocks and a["round"] != b["round"] \
                    and tps(a) and tps(b):
                blocks[a["mode"]].append((b["round"], rep, tps(b) / tps(a)))
    rounds: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    first: dict[tuple[int, int], str] = {}
    for w in slices:
        key = (w["round"], w.get("replica", 0))
        rounds.setdefault(key, {})[w["mode"]] = w
        first.setdefault(key, w["mode"])
    kinds: dict[str, list[Pair]] = {"untraced": [], "full": []}
    for key, r in rounds.items():
        if "full" in r and "untraced" in r and tps(r["untraced"]):
            # the round's second slice is the fresh one
            second = "full" if first[key] == "untraced" else "untraced"
            kinds[second].append((*key, tps(r["full"]) / tps(r["untraced"])))
    return {"traced_next_vs_after_resume": clustered_ci(blocks["full"]),
            "untraced_next_vs_after_pause": clustered_ci(blocks["untraced"]),
            "tokens_per_s_pairs_traced_after_resume": clustered_ci(kinds["full"]),
            "tokens_per_s_pairs_untraced_after_pause": clustered_ci(kinds["untraced"]),
            "by_position": by_position(slices)}


def round_cells(slices: list[dict[str, Any]]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """Each replica's slices of each round, in the order they ran (records of old,
    without ``replica``, are replica 0's): a slice's index is its place in the round."""
    cells: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for w in slices:
        cells.setdefault((w["round"], w.get("replica", 0)), []).append(w)
    for ws in cells.values():
        ws.sort(key=lambda w: w.get("t0", 0.0))
    return cells


def by_position(slices: list[dict[str, Any]]) -> dict[str, Any]:
    """Each slice's tokens/s over its round's geometric mean (of its replica's slices
    of that round), by mode and place in the round (``MODE@0``: the round's first): a
    slowness of a place that every mode in it shares is the run's, not a mode's (the
    pairs' order alternates, so it weighs on full and untraced alike). Only rounds with
    every slice measured."""
    rounds = round_cells(slices)
    size = max((len(ws) for ws in rounds.values()), default=0)
    values: dict[str, list[tuple[int, float]]] = {}
    for (rnd, _), ws in rounds.items():
        if len(ws) < size or not all(tps(w) for w in ws):
            continue
        mean = statistics.fmean(math.log(tps(w)) for w in ws)
        for place, w in enumerate(ws):
            values.setdefault(f"{w['mode']}@{place}", []).append(
                (rnd, math.exp(math.log(tps(w)) - mean)))
    return {key: clustered_mean(v) for key, v in sorted(values.items())}


def place_adjusted(slices: list[dict[str, Any]], draws: int = 300,
                   seed: int = 0) -> dict[str, Any] | None:
    """Each mode's tokens/s over untraced's with what a slice's place in its round
    costs taken out: log tokens/s = its (round, replica) + its place (for rounds of
    its size; the first place is the reference) + its mode (untraced the reference),
    by least squares within each (round, replica); 95% intervals from resampling
    whole rounds. The pair ratios assume that the places weigh on every mode alike,
    which the ABBA order makes true of full and untraced, but not of a slice that
    always takes one place: the nine H200 calls' null slices always came last, where
    the round's first slice was 1-2% slow in every mode. The places are fitted per run
    (``run``, which ``pool`` sets: runs on other hosts and loads weigh their places
    differently), so a run whose null always takes one place tells nothing of the
    null's effect and does not bend it; ``places`` are then ``RUN:SIZE@PLACE``.
    ``full_vs_none-traced``: full against a host where nothing is traced.
    ``identified``: False where a mode and a place go together in every round of every
    run (nothing tells them apart: no ratio then)."""
    import numpy as np

    cells = round_cells([w for w in slices if "t0" in w and tps(w) > 0])
    rows = []  # (round, cell, log tokens/s, (run, round size, place), mode)
    for c, (key, ws) in enumerate(sorted(cells.items())):
        if len(ws) < 2:
            continue
        for place, w in enumerate(ws):
            rows.append((key[0], c, math.log(tps(w)), (w.get("run", 0), len(ws), place),
                         w["mode"]))
    if not rows or "untraced" not in {r[4] for r in rows}:
        return None
    modes = sorted({r[4] for r in rows} - {"untraced"})
    places = sorted({r[3] for r in rows if r[3][2] > 0})
    x = np.array([[float(r[4] == m) for m in modes] + [float(r[3] == p) for p in places]
                  for r in rows])
    y = np.array([r[2] for r in rows])
    cell = np.array([r[1] for r in rows])
    by_round: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_round.setdefault(r[0], []).append(i)

    def fit(index: np.ndarray) -> np.ndarray | None:
        # each (round, replica) demeaned: its own level drops out; a resampled round
        # is its cells again, demeaned alike
        xy = np.column_stack([x[index], y[index]])
        _, inverse = np.unique(cell[index], return_inverse=True)
        sums = np.zeros((inverse.max() + 1, xy.shape[1]))
        np.add.at(sums, inverse, xy)
        demeaned = xy - sums[inverse] / np.bincount(inverse)[inverse, None]
        xd, yd = demeaned[:, :-1], demeaned[:, -1]
        if np.linalg.matrix_rank(xd) < xd.shape[1]:
            return None
        return np.linalg.lstsq(xd, yd, rcond=None)[0]

    point = fit(np.arange(len(rows)))
    if point is None:
        return {"identified": False, "slices": len(rows)}
    rng = random.Random(seed)
    keys = sorted(by_round)
    boot = []
    for _ in range(draws):
        pick = [i for k in (rng.choice(keys) for _ in keys) for i in by_round[k]]
        b = fit(np.array(pick))
        if b is not None:
            boot.append(b)

    def effect(weights: dict[int, float]) -> dict[str, Any]:
        value = sum(w * point[j] for j, w in weights.items())
        drawn = sorted(sum(w * b[j] for j, w in weights.items()) for b in boot)
        out: dict[str, Any] = {"ratio": round(math.exp(value), 4)}
        if len(drawn) >= 20:
            out["ci95"] = [round(math.exp(pct(drawn, 0.025) or 0.0), 4),
                           round(math.exp(pct(drawn, 0.975) or 0.0), 4)]
        return out

    out: dict[str, Any] = {"identified": True, "slices": len(rows), "rounds": len(keys),
                           "draws": len(boot)}
    for j, m in enumerate(modes):
        out[f"{m}_vs_untraced"] = effect({j: 1.0})
    # a place against the first of rounds of its size ("3@2": the third of three;
    # "1:3@2" that of the second run pooled)
    n_runs = len({p[0] for p in places})
    out["places"] = {(f"{run}:" if n_runs > 1 else "") + f"{n}@{p}": effect({len(modes) + j: 1.0})
                     for j, (run, n, p) in enumerate(places)}
    if "full" in modes and NONE_TRACED in modes:
        out[f"full_vs_{NONE_TRACED}"] = effect({modes.index("full"): 1.0,
                                                modes.index(NONE_TRACED): -1.0})
    return out


LaneRounds = dict[tuple[int, int], dict[str, dict[str, Any]]]  # (round, replica) -> mode -> record


def lane_rounds(windows: list[dict[str, Any]]) -> LaneRounds:
    """Each replica's slices (windows) of each round, by mode; records of old (no
    ``replica``) are replica 0's."""
    rounds: LaneRounds = {}
    for w in windows:
        rounds.setdefault((w["round"], w.get("replica", 0)), {})[w["mode"]] = w
    return rounds


def tps(w: dict[str, Any]) -> float:
    """A slice's (window's) output tokens per second."""
    return w["tokens"] / w["wall_s"] if w["wall_s"] else 0.0


def cpt(w: dict[str, Any]) -> float:
    """A slice's (window's) server CPU seconds per output token."""
    return w["server_cpu_s"] / max(1, w["tokens"])


def per_replica(full: list[tuple[tuple[int, int], dict[str, Any], dict[str, Any]]]
                ) -> list[dict[str, Any]]:
    """Each replica's own tokens/s and server CPU per token ratios (``ratio_ci`` over its
    pairs), and its untraced tokens/s: a replica unlike the others (a slow GPU) shows."""
    reps: dict[int, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for (_, rep), t, u in full:
        reps.setdefault(rep, []).append((t, u))
    return [{"replica": rep,
             "tokens_per_s": ratio_ci([tps(t) / tps(u) for t, u in ps if tps(u)]),
             "server_cpu_per_token": ratio_ci([cpt(t) / cpt(u) for t, u in ps if cpt(u)]),
             "tokens_per_s_untraced": round(statistics.fmean(tps(u) for _, u in ps), 1)}
            for rep, ps in sorted(reps.items())]


def full_pairs(rounds: LaneRounds) -> list[tuple[tuple[int, int], dict[str, Any], dict[str, Any]]]:
    """Each (round, replica) with both a full and an untraced slice: (key, full, untraced)."""
    return [(key, r["full"], r["untraced"]) for key, r in rounds.items()
            if "full" in r and "untraced" in r]


def headline(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Full against untraced, tokens/s and server CPU per token: what a run's progress
    and its stopping rule read after every round (``summarise`` has the rest; its TTFT
    bootstraps take seconds late in a run, which the load would spend waiting)."""
    full = full_pairs(lane_rounds(windows))
    return {"tokens_per_s": clustered_ci([(*k, tps(t) / tps(u)) for k, t, u in full if tps(u)]),
            "server_cpu_per_token": clustered_ci([(*k, cpt(t) / cpt(u)) for k, t, u in full
                                                  if cpt(u)])}


def summarise(windows: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Per round and replica, each mode against that round's untraced slice (window) of
    the same replica; intervals over rounds (``clustered_ci``)."""
    rounds = lane_rounds(windows)
    full = full_pairs(rounds)
    by_round: dict[int, list[SlicePair]] = {}
    for (rnd, _), t, u in full:
        by_round.setdefault(rnd, []).append((t, u))
    clusters = list(by_round.values())

    rng = random.Random(0)
    head = headline(windows)
    out: dict[str, Any] = {
        "tokens_per_s": head["tokens_per_s"],
        "ttft_p50": ttft_ratios(clusters, 0.5, rng) if full else {},
        "ttft_p99": ttft_ratios(clusters, 0.99, rng) if full else {},
        # the same without the requests that waited through a stall of the whole server
        # (stall_rates: whether the tracer makes them more often)
        "ttft_p99_outside_stalls": ttft_ratios(clusters, 0.99, rng, ttfts=unstalled)
        if full and "stalls" in full[0][1] else {},
        "stalls": stall_rates(windows),
        "server_cpu_per_token": head["server_cpu_per_token"],
        "tokens_per_s_untraced": round(statistics.fmean(tps(u) for _, _, u in full), 1) if full else None,
        "errors": sum(w["errors"] for w in windows),
        "short_requests": sum(w.get("short_requests", 0) for w in windows),
    }
    if full:
        out["per_replica"] = per_replica(full)
    if windows and "t0" not in windows[0]:  # windows: the same work each?
        tok = [w["tokens"] for w in windows]
        out["tokens_per_window"] = {"min": min(tok), "max": max(tok), "distinct": len(set(tok))}
    parts = {}
    for m in modes:
        if m in ("untraced", "full") or m.startswith("untraced@"):
            continue
        rows = [(key, r[m], r["full"], r[base], r["untraced"]) for key, r in rounds.items()
                if m in r and "full" in r and "untraced" in r
                and (base := own_baseline(r, m)) in r]
        if rows:
            parts[m] = part_ratios(rows)
    if parts:
        out["breakdown"] = parts
    if windows and "server_sys_s" in windows[0]:
        out["server_sys"] = sys_time(windows, rounds)
    if any("host_speed" in w for w in windows):
        out["host_speed"] = host_speed(windows, rounds)
    if windows and "server_voluntary_switches" in windows[0]:
        out["server_sched"] = sched_time(windows, rounds)
    for mode in sorted({w["mode"] for w in windows if w.get("programs")}):
        # the programs' counts are agent-wide (every replica's server): per token over
        # the tokens of every replica's census slices of those rounds. "census" for
        # full tracing, "census_MODE" for a census taken in another mode
        census = [w for w in windows if w.get("programs") and w["mode"] == mode]
        with_programs = {w["round"] for w in census}
        lanes = [w for w in windows if w["mode"] == mode and w["round"] in with_programs]
        key = mode.replace("-", "_", 1)
        out[key] = program_census(census, lanes)
        counted = [w for w in census if "server_syscalls" in w]
        if counted:
            from bench.syscall_watch import rates
            out[key]["server_syscalls"] = rates([w["server_syscalls"] for w in counted],
                                                sum(w["wall_s"] for w in counted))
    if windows and "t0" in windows[0]:
        out["switch_effects"] = switch_effects(windows)
        adjusted = place_adjusted(windows)
        if adjusted:
            out["place_adjusted"] = adjusted
    return out


def own_baseline(r: dict[str, dict[str, Any]], mode: str) -> str:
    """The untraced slice ``mode`` is set against in a round: its own (``untraced@MODE``,
    a crossover ``--variants`` mode's) where there is one, else the round's."""
    own = baseline_of(mode)
    return own if own in r else "untraced"


PartRow = tuple[tuple[int, int], dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]


def part_ratios(rows: list[PartRow]) -> dict[str, Any]:
    """One part's mode against the round's full and untraced slices of its replica
    (``rows``: (round, replica), part, full, the part's untraced slice, full's untraced
    slice; the two untraced slices are one but in a crossover run with
    ``--variants``). Against full: the two ratios to their own untraced slices set
    against each other (with one untraced slice, part over full)."""
    # what the mode saves (or, stub-naming-open, adds) of the server CPU per token
    # full tracing adds over untraced: a part's share of the overhead
    added = [cpt(f) - cpt(uf) for _, _, f, _, uf in rows]
    saved = [(cpt(f) - cpt(uf)) - (cpt(p) - cpt(u)) for _, p, f, u, uf in rows]
    # TTFT quantiles pooled over the part's slices, against its untraced slices and
    # against full's slices of the same rounds (resampled by round, as for full)
    vs_untraced: dict[int, list[SlicePair]] = {}
    vs_full: dict[int, list[SlicePair]] = {}
    for (rnd, _), p, f, u, _ in rows:
        vs_untraced.setdefault(rnd, []).append((p, u))
        vs_full.setdefault(rnd, []).append((p, f))
    ttft: dict[str, Any] = {}
    if all("ttft_ms" in p for _, p, _, _, _ in rows):
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            ttft[f"ttft_{name}_vs_untraced"] = ttft_ratios(list(vs_untraced.values()), q,
                                                           random.Random(0))
            ttft[f"ttft_{name}_vs_full"] = ttft_ratios(list(vs_full.values()), q,
                                                       random.Random(0))
    return {**ttft, "tokens_per_s_vs_untraced": clustered_ci([(*k, tps(p) / tps(u))
                                                      for k, p, _, u, _ in rows if tps(u)]),
            "tokens_per_s_vs_full": clustered_ci([
                (*k, (tps(p) / tps(u)) / (tps(f) / tps(uf)))
                for k, p, f, u, uf in rows if tps(u) and tps(f) and tps(uf)]),
            "server_cpu_per_token_vs_untraced": clustered_ci([(*k, cpt(p) / cpt(u))
                                                              for k, p, _, u, _ in rows]),
            "server_cpu_per_token_vs_full": clustered_ci([
                (*k, (cpt(p) / cpt(u)) / (cpt(f) / cpt(uf))) for k, p, f, u, uf in rows]),
            "share_of_added_server_cpu": round(statistics.fmean(saved) / statistics.fmean(added), 3)
            if statistics.fmean(added) > 0 else None,
            "agent_cpu_per_1k_requests_s": round(1000 * sum(r[1]["agent_cpu_s"] for r in rows)
                                                 / max(1, sum(r[1]["requests"] for r in rows)), 4)}


def sys_time(windows: list[dict[str, Any]], rounds: LaneRounds) -> dict[str, Any]:
    """The server's system CPU per second of each mode, and per round what each traced
    mode adds over that round's untraced slice (mean, 95% interval): uprobe traps and
    syscall-tracepoint programs run there, in the traced threads, so this is the
    probes' own cost measured where it is paid (plus any syscalls the probes make the
    server do, none by design). A GIL-bound server loses about this share of its
    throughput where the probes fire with the GIL held (launches), less where they
    fire in a syscall that released it (socket I/O). Per round the mean over its
    replicas of each replica's added system CPU per second, the interval over rounds
    (``clustered_mean``). The same added time also as a share of the untraced
    slice's whole server CPU (``_added_share_of_server_cpu``: the throughput a
    CPU-bound server would lose to it) and per output token (``_added_us_per_token``:
    each slice's system CPU over its own tokens), so servers of different token rates
    compare."""
    def per_s(w: dict[str, Any]) -> float:
        return w["server_sys_s"] / w["wall_s"] if w["wall_s"] else 0.0

    def added(w: dict[str, Any], u: dict[str, Any]) -> float:
        return per_s(w) - per_s(u)

    def share(w: dict[str, Any], u: dict[str, Any]) -> float | None:
        cpu = u.get("server_cpu_s") or 0.0
        return added(w, u) / (cpu / u["wall_s"]) if cpu and u["wall_s"] else None

    def us_per_token(w: dict[str, Any], u: dict[str, Any]) -> float | None:
        if not w.get("tokens") or not u.get("tokens"):
            return None
        return (w["server_sys_s"] / w["tokens"] - u["server_sys_s"] / u["tokens"]) * 1e6

    per_mode: dict[str, list[float]] = {}
    for w in windows:
        per_mode.setdefault(w["mode"], []).append(per_s(w))
    out: dict[str, Any] = {"per_s": {m: round(statistics.fmean(v), 4)
                                     for m, v in per_mode.items()}}
    measures = (("per_s", added), ("share_of_server_cpu", share),
                ("us_per_token", us_per_token))
    for m in per_mode:
        if m.startswith("untraced"):
            continue
        pairs = [(rnd, r[m], r[own_baseline(r, m)]) for (rnd, _), r in rounds.items()
                 if m in r and own_baseline(r, m) in r]
        for name, f in measures:
            vals = [(rnd, f(w, u)) for rnd, w, u in pairs]
            est = clustered_mean([(rnd, v) for rnd, v in vals if v is not None])
            if est is not None:
                out[f"{m}_added_{name}"] = est
        if m == "full" or "full" not in per_mode:
            continue
        # what the mode adds less what full adds, each over its own untraced slice,
        # paired by round and replica: a part's cost where both ran in one round
        rows = [(rnd, r[m], r[own_baseline(r, m)], r["full"], r["untraced"])
                for (rnd, _), r in rounds.items()
                if m in r and own_baseline(r, m) in r and "full" in r and "untraced" in r]
        for name, f in measures[1:]:
            diffs = [(rnd, a - b) for rnd, p, u, fl, uf in rows
                     if (a := f(p, u)) is not None and (b := f(fl, uf)) is not None]
            est = clustered_mean(diffs)
            if est is not None:
                out[f"{m}_minus_full_added_{name}"] = est
    return out


def host_speed(windows: list[dict[str, Any]], rounds: LaneRounds) -> dict[str, Any]:
    """bench/host_speed.py's meters: chunks per second per mode; per traced mode its
    ratio to the round's untraced slice (interval over rounds): below 1, the host
    itself ran slower while traced (the meters' CPUs run nothing of the server's or the
    agent's); and per mode the correlation over time slices of a meter's log rate with
    the replicas' mean log tokens/s (near 1: the slices' noise is the host's speed)."""
    timed = [w for w in windows if "host_speed" in w]
    kinds = sorted({k for w in timed for k in w["host_speed"]})
    out: dict[str, Any] = {}
    tokens: dict[tuple[int, str], list[float]] = {}
    for w in windows:
        if w.get("tokens") and w.get("wall_s"):
            tokens.setdefault((w["round"], w["mode"]), []).append(math.log(tps(w)))
    for kind in kinds:
        per_mode: dict[str, list[dict[str, Any]]] = {}
        for w in timed:
            if w["host_speed"].get(kind):
                per_mode.setdefault(w["mode"], []).append(w)
        row: dict[str, Any] = {m: round(statistics.fmean(w["host_speed"][kind] for w in ws), 1)
                               for m, ws in per_mode.items()}
        for m in per_mode:
            if m == "untraced":
                continue
            pairs = [(rnd, 0, r[m]["host_speed"][kind] / r["untraced"]["host_speed"][kind])
                     for (rnd, rep), r in rounds.items() if m in r and "untraced" in r
                     and r[m].get("host_speed", {}).get(kind)
                     and r["untraced"].get("host_speed", {}).get(kind)]
            if pairs:
                row[f"{m}_vs_untraced"] = clustered_ci(pairs)
        for m, ws in per_mode.items():
            xs = [(math.log(w["host_speed"][kind]), statistics.fmean(tokens[w["round"], m]))
                  for w in ws if tokens.get((w["round"], m))]
            if len(xs) > 2 and len({x for x, _ in xs}) > 1 and len({y for _, y in xs}) > 1:
                row[f"{m}_correlation_with_tokens_per_s"] = round(
                    statistics.correlation([x for x, _ in xs], [y for _, y in xs]), 3)
        out[kind] = row
    return out


def sched_time(windows: list[dict[str, Any]], rounds: LaneRounds) -> dict[str, Any]:
    """The server's scheduling per mode: voluntary and involuntary context switches
    per output token (a GIL handed over, a futex waited on) and the share of each
    second its threads spent runnable but off a CPU; per traced mode the ratio of its
    voluntary switches per token to the round's untraced slice of the same replica
    (interval over rounds, ``clustered_ci``)."""
    def per_token(w: dict[str, Any], key: str) -> float:
        return w[key] / w["tokens"] if w.get("tokens") else 0.0

    out: dict[str, Any] = {}
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for w in windows:
        if w.get("tokens"):
            by_mode.setdefault(w["mode"], []).append(w)
    for m, ws in by_mode.items():
        out[m] = {"voluntary_per_token": round(statistics.fmean(
                      per_token(w, "server_voluntary_switches") for w in ws), 3),
                  "involuntary_per_token": round(statistics.fmean(
                      per_token(w, "server_involuntary_switches") for w in ws), 3),
                  "run_delay_per_s": round(statistics.fmean(
                      w["server_run_delay_s"] / w["wall_s"] for w in ws), 4)}
    for m in by_mode:
        if m == "untraced":
            continue
        rows = [(*key, per_token(r[m], "server_voluntary_switches")
                 / per_token(r["untraced"], "server_voluntary_switches"))
                for key, r in rounds.items() if m in r and "untraced" in r
                and r[m].get("tokens") and per_token(r["untraced"], "server_voluntary_switches")]
        if rows:
            out[f"{m}_voluntary_per_token_vs_untraced"] = clustered_ci(rows)
    return out


def program_census(census: list[dict[str, Any]],
                   lanes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Census slices: each BPF program's runs per second and per output token, and
    its mean run time (inside BPF only: a uprobe's trap is on top). ``census``: the
    records that carry the agent-wide counts (one per time slice: replica 0's);
    ``lanes``: every replica's records of those time slices, whose tokens the counts
    are per (default: ``census``'s own). Per second is per second of time: all the
    replicas' servers together."""
    wall = sum(w["wall_s"] for w in census)
    tokens = sum(w.get("tokens", 0) for w in (census if lanes is None else lanes))
    totals: dict[str, list[int]] = {}
    for w in census:
        for name, (runs, ns) in w["programs"].items():
            t = totals.setdefault(name, [0, 0])
            t[0] += runs
            t[1] += ns
    rows = {name: {"runs_per_s": round(runs / wall, 1),
                   "runs_per_token": round(runs / tokens, 3) if tokens else None,
                   "ns_per_run": round(ns / runs, 1) if runs else None,
                   "bpf_cpu_share": round(ns / wall / 1e9, 5)}
            for name, (runs, ns) in sorted(totals.items(), key=lambda kv: -kv[1][0]) if runs}
    out = {"slices": len(census), "seconds": round(wall, 2), "tokens": tokens,
           "programs": rows,
           "bpf_cpu_share_all": round(sum(ns for _, ns in totals.values()) / wall / 1e9, 5)}
    if lanes is not None and len({w.get("replica", 0) for w in lanes}) > 1:
        out["replicas"] = len({w.get("replica", 0) for w in lanes})
    return out


def partial_seconds_per_round(slices: list[dict[str, Any]]) -> float:
    """A --partial file's seconds a round, from its slices' start times."""
    rounds = max((w["round"] for w in slices), default=0)
    if rounds < 2:
        return 0.0
    t0s = [w["t0"] for w in slices]
    return round((max(t0s) - min(t0s)) / (rounds - 1), 2)


TTFT_QUANTILES = ("ttft_p50", "ttft_p99", "ttft_p99_outside_stalls")  # each run's own


def combine_ratios(per_run: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Runs' own ratios (``{"ratio", "ci95"}`` each, a 95% interval) as one: their log
    ratios averaged with weights 1 / variance, the variance read off each interval's
    width (a fixed-effect meta-analysis: each run's quantiles are its own, only the
    ratios are pooled). ``q``: Cochran's heterogeneity statistic, about ``runs - 1``
    when the runs agree within their intervals; much more and the interval is too
    narrow for them. None below two runs with an interval."""
    logs = []
    for r in per_run:
        ci = (r or {}).get("ci95")
        if not r or not r.get("ratio") or not ci or ci[0] <= 0 or ci[1] <= ci[0]:
            continue
        se = (math.log(ci[1]) - math.log(ci[0])) / (2 * 1.96)
        logs.append((math.log(r["ratio"]), 1 / se ** 2))
    if len(logs) < 2:
        return None
    total = sum(w for _, w in logs)
    mean = sum(x * w for x, w in logs) / total
    hw = 1.96 / math.sqrt(total)
    q = sum(w * (x - mean) ** 2 for x, w in logs)
    return {"runs": len(logs), "ratio": round(math.exp(mean), 4),
            "ci95": [round(math.exp(mean - hw), 4), round(math.exp(mean + hw), 4)],
            "q": round(q, 2)}


def pool(files: list[str], target: float) -> dict[str, Any]:
    """Several runs' pairs as one sample (their rounds numbered apart, their replicas
    kept; records of old, without ``replica``, are replica 0's). A ``--partial`` file
    counts as a crossover run of the slices it holds."""
    runs: dict[str, list[dict[str, Any]]] = {}
    seconds: dict[str, float] = {}
    ttft: dict[str, dict[str, list[Any]]] = {}
    for i, f in enumerate(files):
        doc = json.loads(Path(f).read_text())
        # a --partial file (a run cut short): its slices, as one crossover run's
        results = doc["results"] if "results" in doc else [
            {"server": doc["server"], "mode": "slices", "design": "crossover",
             "slices": [w for w in doc["slices"] if "tokens" in w],
             "seconds_per_round": partial_seconds_per_round(doc["slices"])}]
        for r in results:
            ws = r.get("slices") or r.get("windows") or []
            design = r.get("design", "alternate")  # designs differ in noise: apart
            key = f"{r['server']} ({r.get('mode', 'windows')}" + (
                ")" if design == "alternate" else f", {design})")
            runs.setdefault(key, []).extend(dict(w, round=w["round"] + 100000 * i, run=i,
                                                 replica=w.get("replica", 0)) for w in ws)
            per_round = r.get("seconds_per_round", r.get("seconds_per_pair", 0.0))
            seconds[key] = seconds.get(key, 0.0) + per_round * max(
                (w["round"] for w in ws), default=0)
            for q in TTFT_QUANTILES:
                ttft.setdefault(key, {}).setdefault(q + "_per_file", []).append(r.get(q))
    out: dict[str, Any] = {"files": files}
    for key, ws in runs.items():
        # each mode the runs have: the parts of --breakdown pooled too, over the runs
        # (and rounds) that had them
        parts = sorted({w["mode"] for w in ws} - {"untraced", "full"})
        stats = summarise(ws, ["untraced", "full", *parts])
        if len(files) > 1:  # a quantile of runs of different speeds pooled is neither's:
            for q in TTFT_QUANTILES:  # each file's own
                stats.pop(q, None)
            stats.update(ttft[key])
            for q in TTFT_QUANTILES:
                stats[q + "_combined"] = combine_ratios(ttft[key][q + "_per_file"])
            for part in stats.get("breakdown", {}).values():  # the parts' alike
                for q in [q for q in part if q.startswith("ttft_")]:
                    del part[q]
        rounds = stats["tokens_per_s"].get("rounds") or 0
        for k in ("tokens_per_s", "server_cpu_per_token"):
            add_targets(stats[k], target, seconds[key] / rounds if seconds[key] and rounds
                        else None)
        stats["replicas"] = len(stats.get("per_replica", []))
        out[key] = stats
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="hf-cb,hf-plain,batching,grpc")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--mode", default="slices", choices=("slices", "windows"),
                    help="slices: continuous load cut into time slices (default); windows: "
                         "the whole mix per window")
    ap.add_argument("--requests", type=int, default=32,
                    help="requests in the mix (windows: per window; slices: repeated)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--max-tokens", default="16:48", metavar="LO:HI",
                    help="each request's max_tokens, drawn once per mix")
    ap.add_argument("--slice-s", type=float, default=3.0, help="seconds per slice (slices)")
    ap.add_argument("--first-tokens-s", type=float, default=240.0, metavar="S",
                    help="slices: a replica whose load has had no token S seconds after "
                         "it began is restarted once, then given up on (default 240)")
    ap.add_argument("--warmup-s", type=float, default=10.0,
                    help="seconds of load, once tokens flow, before the agent starts (slices)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="windows before the agent starts (windows)")
    ap.add_argument("--min-pairs", type=int, default=8,
                    help="at least this many rounds (a pair per replica each)")
    ap.add_argument("--max-pairs", type=int, default=400,
                    help="at most this many rounds (a pair per replica each)")
    ap.add_argument("--replicas", type=int, default=1, metavar="N",
                    help="slices: N servers at once (on CUDA one per GPU, round robin), "
                         "each with its own client and CPUs, traced by one agent: N pairs "
                         "a round, intervals over rounds")
    ap.add_argument("--design", default="alternate", choices=("alternate", "crossover"),
                    help="slices: alternate (every replica traced or untraced together, "
                         "one agent) or crossover (an agent per half of an even number "
                         "of replicas, one half traced while the other is not, swapped "
                         "each slice: the host's own drift cancels within a slice)")
    ap.add_argument("--variants", type=lambda v: [m for m in v.split(",") if m], default=[],
                    metavar="M,M",
                    help="crossover: each round also traces each half in mode M (a part "
                         "off while the rest traces: net-syscall, no-payload, sampled, "
                         "sampled-copies, sockets-only, no-launch-probes, ...), the other "
                         "half untraced at the same moments: the part's cost paired by "
                         "round (breakdown and server_sys's M_minus_full_ in the output)")
    ap.add_argument("--null-every", type=int, default=0, metavar="N",
                    help="crossover: every Nth round a slice with neither half traced, "
                         "to measure what the traced half's probes cost the untraced "
                         "half (none-traced in the output; default 0: none)")
    ap.add_argument("--agent-cpus", type=int, default=1, metavar="K",
                    help="CPUs for the agent, before the replicas' (default 1)")
    ap.add_argument("--server-cpus", type=lambda v: [int(x) for x in v.split(",")],
                    metavar="N[,N...]",
                    help="replica i's server on only the first N (the i-th of the list; "
                         "the last for the rest) of its CPUs, to compare CPU plans' noise "
                         "and overhead in one run (default: all of its share)")
    ap.add_argument("--agent-load", type=float, default=0.4, metavar="CORES",
                    help="the agent-load part's load on the agent's CPUs (default 0.4: "
                         "about what the agent's analysis of 4 HF serve servers takes)")
    ap.add_argument("--speed-meter", action="store_true",
                    help="slices: bench/host_speed.py's meters on two unused CPUs, to see "
                         "whether the host runs slower while traced (host_speed)")
    ap.add_argument("--target", type=float, default=0.01,
                    help="stop once the tokens/s ratio's 95%% interval is this narrow either side")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="seconds of slices (windows) and switches per server")
    ap.add_argument("--settle-s", type=float, default=0.5,
                    help="wait after each switch before measuring")
    ap.add_argument("--settle-resume-s", type=float, default=None, metavar="S",
                    help="slices: wait this long after a resume instead (default: "
                         "--settle-s; see switch_effects in the output)")
    ap.add_argument("--breakdown", action="store_true", help="also each part off in turn")
    ap.add_argument("--breakdown-modes", metavar="M,M", default="",
                    help="only these parts of --breakdown (no-payload, no-analysis, "
                         "net-syscall, census, "
                         "slow-path, agent-load, duty-0.2, duty-0.5, no-launch-probes, "
                         "sockets-only, burst-min-1ms, "
                         "stub-naming-open, alias-lookups-open, sampled, sampled-p5, "
                         "sampled-copies, period-2, period-4, census-period-2)")
    ap.add_argument("--sample-fraction", type=float, default=0.1, metavar="F",
                    help="the sampled part's --gpu-sample (default 0.1; its period is the "
                         "agent's --gpu-sample-period, e.g. --agent-args=--gpu-sample-period=1)")
    ap.add_argument("--sample-period", type=float, metavar="S",
                    help="the sampled part's --gpu-sample-period (default: the agent's; "
                         "sampled-p5 is always 5 s)")
    ap.add_argument("--breakdown-every", type=int, default=1, metavar="N",
                    help="the parts' slices (windows) in every Nth round only (more pairs "
                         "for the headline ratio in the same time)")
    ap.add_argument("--keep-eos", action="store_true",
                    help="serve the tiny Llama as built (sampled EOS, byte-level decoding): "
                         "requests of varying length, chunks of one or more tokens")
    ap.add_argument("--agent-args", default="", help="more `tokentrace run` options")
    ap.add_argument("--agent-ctl", action="append", default=[], metavar="CMD",
                    help="a `tokentrace ctl` command sent to every agent once attached, "
                         "before the first slice, e.g. 'gpu-sample 0.03 1 copies memsets' "
                         "(the memsets sampled, which auto may keep counted); repeatable")
    ap.add_argument("--pool", nargs="+", metavar="JSON",
                    help="no run: the pairs of these result files (the same server and "
                         "design) taken together, printed as JSON (and written to --out "
                         "when it is given)")
    ap.add_argument("--window-log", metavar="DIR",
                    help="slices: each agent's capture (--record), each replica's token "
                         "and request times, and the slices' spans, in DIR, for "
                         "bench/window_effect.py (what --gpu-sample's windows cost the "
                         "requests they touch)")
    ap.add_argument("--partial", metavar="FILE",
                    help="slices: the slices so far, rewritten after every round")
    ap.add_argument("--model-shape", default=(2, 128), metavar="LAYERS,HIDDEN",
                    type=lambda v: tuple(int(x) for x in v.split(",")),
                    help="HF kinds: the Llama's layers and hidden size (default 2,128: "
                         "tiny, each token mostly the server's CPU; larger ones put more "
                         "of a token on the GPU, random weights all the same)")
    ap.add_argument("--out", help="where the result goes (default: "
                    "bench/results/real_server.json; with --pool, only printed)")
    # the load generator's own process
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--client-kind", default="openai", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="tiny-gpt", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        args.url = args.client
        return client_main(args)
    if args.pool:
        pooled = json.dumps(pool(args.pool, args.target), indent=1)
        print(pooled)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(pooled + "\n")
        return 0
    args.out = args.out or str(ROOT / "bench/results/real_server.json")
    if args.server_cpus and min(args.server_cpus) < 1:
        ap.error("--server-cpus counts are at least 1")
    if args.replicas < 1 or args.agent_cpus < 1:
        ap.error("--replicas and --agent-cpus are at least 1")
    if args.replicas > 1 and args.mode != "slices":
        ap.error("--replicas takes --mode slices (windows: one server)")
    if args.design == "crossover" and (args.mode != "slices" or args.replicas % 2
                                       or args.breakdown or args.speed_meter):
        ap.error("--design crossover takes --mode slices, an even --replicas and no "
                 "--breakdown or --speed-meter")
    if args.variants and (args.design != "crossover" or any(
            m not in MODES or m in ("untraced", "full", "slow-path", "agent-load") or is_census(m)
            for m in args.variants)):
        ap.error("--variants takes --design crossover and modes one agent sets for its own "
                 "servers (not census, slow-path or agent-load): " + ",".join(args.variants))
    if args.null_every < 0 or (args.null_every and args.design != "crossover"):
        ap.error("--null-every takes --design crossover and N >= 0")
    if args.window_log and (args.mode != "slices" or "," in args.servers):
        ap.error("--window-log takes --mode slices and one server kind")
    if os.geteuid() != 0:
        raise SystemExit("needs root (BPF)")
    if args.window_log:
        Path(args.window_log).mkdir(parents=True, exist_ok=True)
    results = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tt-real-") as tmp:
        for kind in args.servers.split(","):
            work = Path(tmp, kind)
            work.mkdir()
            results.append(run_server(kind, args, work))
            r = results[-1]
            print(json.dumps({k: r.get(k) for k in ("server", "mode", "replicas", "tokens_per_s",
                                                   "ttft_p50", "ttft_p99",
                                                   "server_cpu_per_token", "seconds_per_pair",
                                                   "seconds_per_round", "switch_s", "load",
                                                   "short_requests", "errors",
                                                   "agent", "breakdown")}, default=str),
                  file=sys.stderr, flush=True)
    doc = {"host_cpus": len(os.sched_getaffinity(0)), "python": sys.version.split()[0],
           "seconds": round(time.monotonic() - t0, 1), "args": vars(args), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    for r in results:
        print(f"{r['server']}: tokens/s {r['tokens_per_s']}  TTFT p50 {r['ttft_p50']}  "
              f"p99 {r['ttft_p99']}  server CPU/token {r['server_cpu_per_token']}  "
              f"agent {json.dumps({k: v for k, v in r['agent'].items() if k != 'report'})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
