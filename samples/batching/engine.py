"""The continuous-batching engine: scheduler, per-step executors, ground truth.

Each step the scheduler admits waiting requests (FIFO) while fewer than ``max_batch``
run, gives every request still in prefill a chunk of up to ``prefill_chunk`` prompt
tokens, and every request past prefill one decode token. The executor runs the step as
one batched tiny-GPT forward: contexts are right-padded, and under causal attention the
padding never reaches a real position, so each row's logits are exactly its own. The
step that finishes a request's prefill emits its first token; every later step emits
one more, until ``max_tokens``.

A step's plan is plain JSON (rank 0 sends it to rank 1 in the tp2 layout).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F

from samples import tinygpt
from samples.batching.gpu import StandinGpu, StandinNccl, kernel_ns
from samples.batching.truth import TruthFile

Plan = dict[str, Any]


@dataclass
class Seq:
    """One request inside the engine."""

    id: str
    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    prefilled: int = 0
    out: list[int] = field(default_factory=list)

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < len(self.prompt)


class Scheduler:
    """FIFO waiting queue, up to ``max_batch`` running, chunked prefill."""

    def __init__(self, max_batch: int, prefill_chunk: int, block: int) -> None:
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be at least 1")
        self.max_batch = max_batch
        self.chunk = prefill_chunk
        self.block = block
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.steps = 0

    def add(self, seq: Seq) -> None:
        if not seq.prompt or seq.max_tokens < 1:
            raise ValueError(f"{seq.id}: empty prompt or max_tokens < 1")
        self.waiting.append(seq)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def plan(self) -> tuple[Plan, list[str]]:
        """The next step's plan and the ids admitted into it."""
        admitted = []
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting.popleft()
            self.running.append(seq)
            admitted.append(seq.id)
        members, rows, new_ids, temps = [], [], [], []
        for seq in self.running:
            if seq.in_prefill:
                end = min(seq.prefilled + self.chunk, len(seq.prompt))
                new = seq.prompt[seq.prefilled:end]
                rows.append(seq.prompt[:end][-self.block:])
                members.append({"id": seq.id, "phase": "prefill", "tokens": len(new),
                                "emits": end == len(seq.prompt)})
            else:
                new = [seq.out[-1]]
                rows.append((seq.prompt + seq.out)[-self.block:])
                members.append({"id": seq.id, "phase": "decode", "tokens": 1, "emits": True})
            new_ids += new
            temps.append(seq.temperature)
        self.steps += 1
        return ({"step": self.steps, "members": members, "rows": rows, "new_ids": new_ids,
                 "temps": temps}, admitted)

    def commit(self, plan: Plan, sampled: list[int]) -> tuple[list[list[Any]], list[str]]:
        """Apply a step's results: the (id, text) tokens it emitted and the ids finished."""
        tokens, finished = [], []
        for seq, m, tok in zip(self.running, plan["members"], sampled):
            assert seq.id == m["id"], "the running set changed under a step"
            if m["phase"] == "prefill":
                seq.prefilled += m["tokens"]
            if m["emits"]:
                seq.out.append(tok)
                tokens.append([seq.id, tinygpt.decode_token(tok)])
                if len(seq.out) >= seq.max_tokens:
                    finished.append(seq.id)
        self.running = [s for s in self.running if s.id not in finished]
        return tokens, finished


@dataclass
class StepTiming:
    t_start_ns: int
    t_end_ns: int
    launches: int | None
    gpu_ns: int


class Executor(Protocol):
    def run(self, plan: Plan) -> tuple[list[int], StepTiming]: ...


def last_logits(model: tinygpt.TinyGPT, idx: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Logits at each row's last real position, (B, vocab)."""
    logits = model(idx)
    b, _, v = logits.shape
    return logits.gather(1, last.view(b, 1, 1).expand(b, 1, v)).squeeze(1)


def pick(logits: torch.Tensor, temps: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Sample per row at its own temperature; temperature 0 is greedy.

    The exponential race (argmax of p / E, E ~ Exp(1)) draws from p exactly as
    ``torch.multinomial`` does for one sample, without the ``.item()`` validity check
    multinomial makes, which would synchronise a CUDA step."""
    probs = F.softmax(logits / temps.clamp_min(1e-6).unsqueeze(1), dim=-1)
    drawn = (probs / torch.empty_like(probs).exponential_(1.0, generator=gen)).argmax(dim=-1)
    return torch.where(temps > 0, drawn, logits.argmax(dim=-1))


def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, T) and each row's last index (B,)."""
    width = max(len(r) for r in rows)
    idx = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        idx[i, :len(r)] = torch.tensor(r)
    return idx, torch.tensor([len(r) - 1 for r in rows])


def step_cost() -> tuple[int, int, int]:
    """Launches a stand-in step makes: (fixed, per member, per prefilling member), from
    ``TT_STEP_COST`` ("6,1,2" unless set: 6 + 3 per prefilling + 1 per decoding member)."""
    parts = [int(x) for x in os.environ.get("TT_STEP_COST", "6,1,2").split(",")]
    if len(parts) != 3 or min(parts) < 0:
        raise ValueError("TT_STEP_COST is FIXED,PER_MEMBER,PER_PREFILL (non-negative)")
    return parts[0], parts[1], parts[2]


class CpuExecutor:
    """The forward on the CPU; with the stand-in libcuda (and libnccl), the driver calls
    a GPU step would make around it: H2D of the input ids, launches by ``step_cost()``
    (a fixed part, a part per member, more per prefilling member), [all-reduce,] D2H
    of the sampled ids, one stream sync. A member's kernels have a block per query
    token (one for a decode, the chunk's tokens for a prefill); the stand-in models a
    kernel's GPU time per block and runs it while the host goes on (the sync waits for
    what is left). Each member's own launches and modelled GPU time go into the truth
    (``cost``, ``time_ns``); the rest of the step's GPU time (the fixed launches) is
    shared. A host slower than the kernels (a loaded machine) stretches the step the
    tracer sees, not its GPU time."""

    def __init__(self, model: tinygpt.TinyGPT, gpu: StandinGpu | None,
                 nccl: StandinNccl | None, max_batch: int, seed: int = 0) -> None:
        self.model = model
        self.gpu = gpu
        self.nccl = nccl
        self.gen = torch.Generator().manual_seed(seed)
        self.kernel_ns = kernel_ns()
        self.cost = step_cost()
        self.d_logits = gpu.alloc(4 * max_batch * model.cfg.vocab) if gpu and nccl else 0

    def run(self, plan: Plan) -> tuple[list[int], StepTiming]:
        members = plan["members"]
        fixed, per_member, per_prefill = self.cost
        for m in members:  # what each member adds: the truth's shares
            m["cost"] = per_member + per_prefill * (m["phase"] == "prefill")
            m["blocks"] = m["tokens"] if m["phase"] == "prefill" else 1
            m["time_ns"] = m["cost"] * m["blocks"] * self.kernel_ns
        launches = fixed + sum(m["cost"] for m in members) if self.gpu else 0
        idx, last = padded(plan["rows"])
        temps = torch.tensor(plan["temps"], dtype=torch.float32)
        t_start = time.monotonic_ns()
        if self.gpu:
            self.gpu.copy_in(plan["new_ids"])
            self.gpu.launch(fixed)
            for m in members:
                self.gpu.launch(m["cost"], grid=m["blocks"])
        with torch.no_grad():
            sampled = pick(last_logits(self.model, idx, last), temps, self.gen).tolist()
        if self.nccl:
            self.nccl.all_reduce(self.d_logits, len(members) * self.model.cfg.vocab)
        if self.gpu:
            self.gpu.copy_out(len(members))
            self.gpu.sync()
        t_end = time.monotonic_ns()
        # the step's GPU time: its kernels' modelled time (they run back to back while
        # the host's forward goes on), what CUDA events around them would measure
        blocks = fixed + sum(m["cost"] * m["blocks"] for m in members)
        return sampled, StepTiming(t_start, t_end, launches if self.gpu else None,
                                   blocks * self.kernel_ns if self.gpu else 0)


class CudaExecutor:
    """The forward on a CUDA device. Inputs go up from pinned buffers without blocking;
    the ``.tolist()`` of the sampled ids is the step's one synchronisation. With
    ``dist`` (tp2), the rows' logits are all-reduced across the ranks (NCCL) first."""

    def __init__(self, model: tinygpt.TinyGPT, device: torch.device, max_batch: int,
                 dist: bool = False, seed: int = 0) -> None:
        self.model, self.device, self.dist = model, device, dist
        n = max_batch * model.cfg.block
        self.idx_h = torch.zeros(n, dtype=torch.long).pin_memory()
        self.last_h = torch.zeros(max_batch, dtype=torch.long).pin_memory()
        self.temps_h = torch.zeros(max_batch, dtype=torch.float32).pin_memory()
        self.idx_d = torch.zeros(n, dtype=torch.long, device=device)
        self.last_d = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.temps_d = torch.zeros(max_batch, dtype=torch.float32, device=device)
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)
        self.ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._warm_up(max_batch)

    def _warm_up(self, max_batch: int) -> None:
        """Load kernels and libraries (cuBLAS, NCCL) before the first timed step."""
        for b, t in ((1, 1), (max_batch, 8), (max_batch, self.model.cfg.block)):
            self.run({"rows": [[0] * t] * b, "temps": [1.0] * b, "members": []})
        torch.cuda.synchronize(self.device)

    def run(self, plan: Plan) -> tuple[list[int], StepTiming]:
        rows = plan["rows"]
        b, t = len(rows), max(len(r) for r in rows)
        idx, last = padded(rows)
        self.idx_h[:b * t].copy_(idx.view(-1))
        self.last_h[:b].copy_(last)
        self.temps_h[:b].copy_(torch.tensor(plan["temps"], dtype=torch.float32))
        t_start = time.monotonic_ns()
        # PyTorch warns of any synchronising call up to the .tolist(): there should be none.
        torch.cuda.set_sync_debug_mode("warn")
        try:
            self.ev[0].record()
            idx_d = self.idx_d[:b * t].view(b, t)
            idx_d.copy_(self.idx_h[:b * t].view(b, t), non_blocking=True)
            self.last_d[:b].copy_(self.last_h[:b], non_blocking=True)
            self.temps_d[:b].copy_(self.temps_h[:b], non_blocking=True)
            with torch.no_grad():
                logits = last_logits(self.model, idx_d, self.last_d[:b])
                if self.dist:
                    import torch.distributed as tdist
                    tdist.all_reduce(logits)
                    logits = logits / tdist.get_world_size()
                out = pick(logits, self.temps_d[:b], self.gen)
            self.ev[1].record()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        sampled = out.tolist()  # the step's one synchronisation
        t_end = time.monotonic_ns()
        gpu_ns = int(self.ev[0].elapsed_time(self.ev[1]) * 1e6)  # both events completed
        return sampled, StepTiming(t_start, t_end, None, gpu_ns)


class Engine:
    """Scheduler + executor + truth: ``step()`` runs one step and returns its output
    message ``{step, tokens, finished, admitted, t_start_ns}``. ``on_plan`` (tp2 rank 0)
    sees each plan before the step runs."""

    def __init__(self, scheduler: Scheduler, executor: Executor, truth: TruthFile,
                 rank: int = 0, on_plan: Callable[[Plan], None] | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.truth = truth
        self.rank = rank
        self.on_plan = on_plan

    def submit(self, msg: dict[str, Any]) -> None:
        """A submit message {id, prompt_ids, max_tokens[, temperature]}."""
        self.scheduler.add(Seq(str(msg["id"]), [int(i) for i in msg["prompt_ids"]],
                               int(msg["max_tokens"]), float(msg.get("temperature", 1.0))))

    def step(self) -> dict[str, Any]:
        plan, admitted = self.scheduler.plan()
        if self.on_plan:
            self.on_plan(plan)
        sampled, timing = self.executor.run(plan)
        write_step(self.truth, self.rank, plan, timing)
        tokens, finished = self.scheduler.commit(plan, sampled)
        return {"step": plan["step"], "tokens": tokens, "finished": finished,
                "admitted": admitted, "t_start_ns": timing.t_start_ns}


def write_step(truth: TruthFile, rank: int, plan: Plan, timing: StepTiming) -> None:
    """The ground-truth line of one step on one rank."""
    truth.write({"type": "step", "rank": rank, "step": plan["step"], "pid": os.getpid(),
                 "tid": threading.get_native_id(), "t_start_ns": timing.t_start_ns,
                 "t_end_ns": timing.t_end_ns, "launches": timing.launches,
                 "gpu_ns": timing.gpu_ns, "members": plan["members"]})
