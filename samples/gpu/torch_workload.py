"""A real PyTorch GPU workload driven line by line on stdin, for validating the CUDA and
NCCL probes on a GPU machine (bench/gpu_validate.py drives it).

Commands (one per line; each answers one JSON line on stdout):
  init            build the tiny GPT on cuda (first kernels resolve here)
  decode N        eager decode loop, N tokens, synchronised per token
  decode_timed N  the same, answering each token's end (CLOCK_MONOTONIC ns, the clock
                  of the probes' timestamps) as well
  suite_eager     under torch.profiler (CUPTI): eager decode, cuBLAS GEMMs, a Triton
                  kernel (torch.compile) if Triton works here
  suite_graph     under the profiler: 100 replays of a CUDA graph captured before
  hf_prep         build a tiny random Llama (transformers) and warm up its generate
  suite_hf        under the profiler: HF generate, 32 new tokens
                  Each suite answers the profiler's GPU kernel and launch-API counts;
                  "suite_eager names" also each kernel's launches by its name.
  quit
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, __file__.rsplit("/samples/", 1)[0])
from samples.tinygpt import load_model  # noqa: E402

LAUNCH_APIS = ("cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernel",
               "cudaLaunchKernelExC", "cuLaunchCooperativeKernel")


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


class Work:
    def __init__(self) -> None:
        self.model = None
        self.dev = torch.device("cuda")

    def init(self) -> dict:
        self.model, self.dev = load_model("cuda")
        self.decode(4)
        return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}

    def decode(self, n: int, timed: bool = False) -> dict:
        ctx = torch.zeros((1, 8), dtype=torch.long, device=self.dev)
        torch.cuda.synchronize()
        ends = []
        cpu0 = time.thread_time()  # this thread's CPU, uprobe traps (system time) included
        t0 = time.perf_counter()
        for _ in range(n):
            nxt = self.model.step(ctx, temperature=0)
            ctx = torch.cat([ctx[:, 1:], nxt[:, None]], dim=1)
            nxt.item()  # one D2H copy + sync per token, as a server's decode loop does
            ends.append(time.monotonic_ns())
        dt = time.perf_counter() - t0
        cpu = time.thread_time() - cpu0
        steps = sorted(b - a for a, b in zip(ends, ends[1:]))
        out = {"tokens": n, "seconds": dt, "tokens_per_s": n / dt,
               "cpu_us_per_token": cpu / n * 1e6,
               "median_token_us": steps[len(steps) // 2] / 1e3 if steps else None}
        if timed:
            out["token_end_ns"] = ends
        return out

    def gemms(self, n: int) -> None:
        a = torch.randn(512, 512, device=self.dev, dtype=torch.float16)
        for _ in range(n):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()

    def triton(self, n: int) -> str:
        try:
            f = torch.compile(lambda t: torch.sin(t) * 2 + t.cos())
            x = torch.randn(4096, device=self.dev)
            f(x)
            torch.cuda.synchronize()
        except Exception as e:  # no Triton/compiler here: say so
            return f"unavailable: {type(e).__name__}: {str(e)[:200]}"
        for _ in range(n):
            x = f(x)
        torch.cuda.synchronize()
        return "ok"

    def suite(self, window: str, names: bool = False) -> dict:
        """Profile one window with CUPTI. "eager": decode, GEMMs and the Triton kernel,
        where every GPU kernel comes from one launch call; "graph": only replays of a
        graph captured beforehand, where one cuGraphLaunch runs several kernels."""
        from torch.profiler import ProfilerActivity, profile

        triton_state, g = self.triton_state, self.graph_obj  # made by prep()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            if window == "eager":
                self.decode(16)
                self.gemms(100)
                if triton_state == "ok":
                    self.triton(100)
            elif window == "hf":
                self.hf_generate(32)
            else:
                for _ in range(100):
                    g.replay()
            torch.cuda.synchronize()
        api: Counter[str] = Counter()
        by_name: Counter[str] = Counter()
        for ev in prof.events():
            if ev.name in LAUNCH_APIS or ev.name in ("cudaGraphLaunch", "cuGraphLaunch"):
                api[ev.name] += 1
            if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA and \
                    not ev.name.startswith("Memcpy") and not ev.name.startswith("Memset"):
                by_name[ev.name] += 1
        out = {"profiler_api_calls": dict(api), "profiler_gpu_kernels": sum(by_name.values()),
               "triton": triton_state}
        if names:
            out["profiler_kernel_names"] = dict(by_name)
        return out

    def prep(self) -> dict:
        """Compile the Triton kernel, capture the graph and run the GEMMs once, outside
        the profiled windows (so that every kernel of a window is resolved before)."""
        self.triton_state = self.triton(1)
        self.graph_obj = self.make_graph()
        self.gemms(1)
        torch.cuda.synchronize()
        return {"triton": self.triton_state}

    def hf_prep(self) -> dict:
        """A tiny random Llama (no download), its generate warmed up."""
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                          max_position_embeddings=256)
        torch.manual_seed(0)
        self.hf = LlamaForCausalLM(cfg).to(self.dev).eval()
        self.hf_ids = torch.randint(0, 512, (1, 16), device=self.dev)
        self.hf_generate(32)
        return {"hf": "ok"}

    def hf_generate(self, n: int) -> None:
        with torch.no_grad():
            self.hf.generate(self.hf_ids, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()

    def microbench(self, n: int) -> dict:
        """ns per call of two probed driver entry points, called through ctypes:
        cuLaunchKernel with a NULL function (rejected at once by the driver; the entry
        probe still fires) and cuStreamQuery on the idle default stream (return probe)."""
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        launch, query = lib.cuLaunchKernel, lib.cuStreamQuery
        launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        query.argtypes = [ctypes.c_void_p]
        out = {}
        for name, call in (("cuLaunchKernel", lambda: launch(None, 1, 1, 1, 1, 1, 1, 0,
                                                              None, None, None)),
                           ("cuStreamQuery", lambda: query(None))):
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            out[name] = (time.perf_counter() - t0) / n * 1e9
        return {"calls": n, "ns_per_call": out}

    def make_graph(self) -> "torch.cuda.CUDAGraph":
        x = torch.randn(256, 256, device=self.dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                torch.relu(x @ x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self._graph_out = torch.relu(x @ x) + 1
        self._graph_in = x
        return g


def main() -> None:
    w = Work()
    torch.cuda.init()  # libcuda is mapped from here on: the tracer can attach
    say({"ready": True})
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "quit":
            break
        if cmd == "init":
            say(w.init())
        elif cmd == "decode":
            say(w.decode(int(rest[0])))
        elif cmd == "decode_timed":
            say(w.decode(int(rest[0]), timed=True))
        elif cmd == "prep":
            say(w.prep())
        elif cmd == "hf_prep":
            say(w.hf_prep())
        elif cmd == "microbench":
            say(w.microbench(int(rest[0])))
        elif cmd.startswith("suite_"):
            say(w.suite(cmd[6:], names="names" in rest))
        else:
            say({"error": f"unknown command {cmd}"})


if __name__ == "__main__":
    main()
