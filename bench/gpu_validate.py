"""Validate the CUDA/NCCL probes on a real GPU machine (run there as root, after
`eval "$(.gpu/setup-bcc.sh)"`): trace samples/gpu/torch_workload.py, compare kernel
launches with PyTorch's profiler (CUPTI) window by window, measure traced vs untraced
decode tokens/s in one run, trace a 2-GPU NCCL all-reduce when two GPUs are present,
and keep a compressed capture for replay tests.

    python3 bench/gpu_validate.py OUT_DIR [--gpu-sample F [F ...]] [--gpu-sample-period S]

--gpu-sample adds decode rounds traced with the launch probes duty-cycled (`tokentrace
run --gpu-sample`): tokens/s against untraced, and the estimated launch count against
the exact count of the fully traced rounds (the decode loop launches the same kernels
each time).

Writes OUT_DIR/gpu-validation.json and OUT_DIR/torch-gpu.ttcap. Uses only the capture
half of tokentrace (no OpenTelemetry or HTTP parsers needed on the GPU host).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracer.correlate.gpu import GpuLedger  # noqa: E402
from tracer.events import capture, schema  # noqa: E402
from tracer.events.gpu import GpuEvent, KernelBurst  # noqa: E402
from tracer.probes.session import CaptureConfig, CaptureSession  # noqa: E402

CONCERNS = ("cuda", "nccl", "process")


class Tracer:
    """A CaptureSession polled on a thread, feeding a GPU ledger and a capture file."""

    def __init__(self, pids: list[int], ledger: GpuLedger, writer: capture.CaptureWriter | None,
                 **config) -> None:
        self.ledger, self.writer = ledger, writer
        self.session = CaptureSession(CaptureConfig(pids=pids, concerns=CONCERNS, **config),
                                      self._sink)
        self._stop = threading.Event()
        self.drops: dict[str, int] = {}
        t0 = time.perf_counter()
        self.session.start()
        self.attach_s = time.perf_counter() - t0
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _sink(self, item) -> None:
        if self.writer is not None:
            self.writer.write(item)
        ev = item
        if isinstance(item, (bytes, bytearray)):
            try:
                ev = schema.decode(bytes(item))
            except schema.WireError:
                return
        if isinstance(ev, GpuEvent):
            self.ledger.handle(ev)
        elif isinstance(ev, schema.DropReport):
            self.drops = dict(ev.counters)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.session.poll()

    def settle(self) -> None:
        time.sleep(0.3)  # two poll periods: flushed bursts reach the ledger

    def open_bursts(self, pid: int) -> list[KernelBurst]:
        """``pid``'s bursts still open in the kernel (GpuProbes.open_bursts): a window's
        count is the ledger's plus these, at both of its ends. A thread whose syncs
        bring results back leaves its calls after the last such sync open (a sync that
        ends no step flushes nothing): torch_workload's Triton loop ends so."""
        bursts = (schema.decode(raw) for raw in self.session.gpu.open_bursts())
        return [b for b in bursts if isinstance(b, KernelBurst) and b.pid == pid]

    def stop(self) -> dict:
        self._stop.set()
        self.thread.join()
        self.session.stop()
        return self.drops


def launched(ledger: GpuLedger, pid: int, open_bursts: Sequence[KernelBurst] = ()
             ) -> Counter[int]:
    """Launches per handle, all threads of ``pid``, so far: the ledger's, with
    ``open_bursts`` (Tracer.open_bursts: calls the kernel holds in bursts not yet
    flushed) added."""
    out: Counter[int] = Counter()
    p = ledger.processes.get(pid)
    for t in (p.threads.values() if p else ()):
        out.update(t.kernels)
    for b in open_bursts:
        out.update(b.handle_counts)
    return out


def totals(ledger: GpuLedger, pid: int, open_bursts: Sequence[KernelBurst] = ()) -> dict:
    """``pid``'s counts in the ledger so far, with ``open_bursts`` (Tracer.open_bursts)
    added: what the kernel had counted at that moment."""
    p = ledger.processes.get(pid)
    threads = list(p.threads.values()) if p is not None else []
    names = p.names if p is not None else {}
    kernels = launched(ledger, pid, open_bursts)
    return {"launches": sum(t.kernel_launches for t in threads)
            + sum(b.launches for b in open_bursts),
            "graph_launches": sum(t.graph_launches for t in threads)
            + sum(b.graph_launches for b in open_bursts),
            "syncs": sum(t.sync_calls for t in threads) + sum(b.sync_calls for b in open_bursts),
            "named": sum(n for h, n in kernels.items() if h in names),
            "kernel_handles": len(kernels)}


def diff(a: dict, b: dict) -> dict:
    return {k: b[k] - a.get(k, 0) for k in b}


class Workload:
    def __init__(self, cpus: set[int] | None = None) -> None:
        """``cpus``: pin the workload there (less drift between rounds)."""
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.p = subprocess.Popen([sys.executable, str(ROOT / "samples/gpu/torch_workload.py")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  preexec_fn=pin)
        assert json.loads(self.p.stdout.readline())["ready"]

    def ask(self, cmd: str) -> dict:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def quit(self) -> None:
        self.p.stdin.write("quit\n")
        self.p.stdin.close()
        self.p.wait(60)


def sampled_rounds(w: "Workload", exact_launches: int, fraction: float,
                   period_s: float) -> dict:
    """Decode rounds with the launch probes duty-cycled, alternating with untraced ones."""
    rounds = []
    for i in range(4):
        order = ("untraced", "sampled") if i % 2 == 0 else ("sampled", "untraced")
        got: dict = {}
        for phase in order:
            led = GpuLedger()
            tr = (Tracer([w.p.pid], led, None, gpu_sample=fraction, gpu_sample_period_s=period_s)
                  if phase == "sampled" else None)
            got[phase] = w.ask("decode 1000")
            if tr is not None:
                tr.settle()
                got["drops"] = tr.stop()
                doc = led.summary()
                (proc,) = [p for p in doc["processes"] if p["pid"] == w.p.pid] or [{}]
                got["estimated"] = proc.get("kernel_launches", 0)
                got["seen"] = proc.get("kernel_launches_seen", 0)
                got["on_share"] = doc.get("launch_sampling", {}).get("measured_on_share")
        rounds.append({"order": order,
                       "untraced_tokens_per_s": got["untraced"]["tokens_per_s"],
                       "sampled_tokens_per_s": got["sampled"]["tokens_per_s"],
                       "launches_estimated": got["estimated"], "launches_seen": got["seen"],
                       "measured_on_share": got["on_share"],
                       "lost_gpu": got["drops"].get("lost_gpu")})
    return {
        "fraction": fraction, "period_s": period_s, "exact_launches_per_round": exact_launches,
        "rounds": rounds,
        "sampled_over_untraced": sum(r["sampled_tokens_per_s"] for r in rounds)
        / sum(r["untraced_tokens_per_s"] for r in rounds),
        "launch_count_errors": [(r["launches_estimated"] - exact_launches) / exact_launches
                                for r in rounds] if exact_launches else None,
    }


def validate_torch(out: Path, samples: list[float] = (), period_s: float = 1.0) -> dict:
    res: dict = {}
    w = Workload()
    ledger = GpuLedger()
    writer = capture.CaptureWriter(out / "torch-gpu.ttcap", capture.new_header(command="gpu_validate"))
    tr = Tracer([w.p.pid], ledger, writer)
    res["attach_seconds"] = tr.attach_s
    res["attached"] = [vars(lib) | {"symbols": len(lib.symbols), "missing": len(lib.missing)}
                       for lib in tr.session.gpu.attached.values()]
    res["attach_errors"] = tr.session.gpu.errors
    res["init"] = w.ask("init")
    res["prep"] = w.ask("prep")
    res["driver_symbols"] = driver_symbols(tr.session.gpu)
    for window in ("eager", "graph"):
        tr.settle()
        before = totals(ledger, w.p.pid, tr.open_bursts(w.p.pid))
        prof = w.ask(f"suite_{window}")
        tr.settle()
        after = totals(ledger, w.p.pid, tr.open_bursts(w.p.pid))
        res[window] = {"profiler": prof, "tracer": diff(before, after)}
    res["drops"] = tr.stop()
    writer.close()
    res["summary_after_capture"] = ledger.summary(top=15)["processes"]
    # overhead: the same decode loop with no probes attached and with them, alternating
    rounds = []
    micro = []
    for i in range(4):  # alternate which phase goes first, so drift cancels
        order = ("untraced", "traced") if i % 2 == 0 else ("traced", "untraced")
        got: dict = {}
        for phase in order:
            led = GpuLedger()
            tr = Tracer([w.p.pid], led, None) if phase == "traced" else None
            got[phase] = (w.ask("decode 1000"), w.ask("microbench 300000"))
            if tr is not None:
                tr.settle()
                drops = tr.stop()
                got["launches"] = totals(led, w.p.pid)["launches"]
                got["lost_gpu"] = drops.get("lost_gpu")
        rounds.append({"order": order,
                       "untraced_tokens_per_s": got["untraced"][0]["tokens_per_s"],
                       "traced_tokens_per_s": got["traced"][0]["tokens_per_s"],
                       "traced_launches_seen": got["launches"], "lost_gpu": got["lost_gpu"]})
        micro.append({"untraced_ns": got["untraced"][1]["ns_per_call"],
                      "traced_ns": got["traced"][1]["ns_per_call"]})
    res["probe_cost_ns"] = {
        api: sum(m["traced_ns"][api] - m["untraced_ns"][api] for m in micro) / len(micro)
        for api in micro[0]["traced_ns"]}
    res["microbench"] = micro
    res["decode_overhead"] = {
        "rounds": rounds,
        "traced_over_untraced": sum(r["traced_tokens_per_s"] for r in rounds)
        / sum(r["untraced_tokens_per_s"] for r in rounds)}
    exact = rounds[0]["traced_launches_seen"]
    res["decode_sampled"] = [sampled_rounds(w, exact, f, period_s) for f in samples]
    w.quit()
    return res


def driver_symbols(gpu) -> dict:
    """Exported libcuda functions in the families we probe: shows which ones this
    driver has that the probe table does not name."""
    import re

    import bcc

    out = {}
    for lib in gpu.attached.values():
        if lib.kind != "cuda":
            continue
        names = {n.decode() for n, _ in bcc.BPF.get_user_functions_and_addresses(
            lib.path.encode(), b".*")}
        pat = re.compile(r"Synchronize|Query|Launch|Memcpy|Memset|MemAlloc|MemFree|"
                         r"GetFunction|GetKernel|Wait")
        out[lib.path] = sorted(n for n in names if pat.search(n))
    return out


def validate_nccl() -> dict:
    import torch

    if torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU(s): the NCCL run needs 2"}
    p = subprocess.Popen([sys.executable, str(ROOT / "samples/gpu/nccl_workload.py")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    ledger = GpuLedger()
    tr = Tracer([p.pid], ledger, None)
    p.stdin.write("go\n")
    p.stdin.flush()
    truth = json.loads(p.stdout.readline())
    p.wait(120)
    tr.settle()
    drops = tr.stop()
    ranks = []
    for pid, proc in ledger.processes.items():
        ops = {}
        for t in proc.threads.values():
            for op, n in t.nccl_ops.items():
                ops.setdefault(op, [0, 0])
                ops[op][0] += n
                ops[op][1] += t.nccl_bytes[op]
        ranks.append({"pid": pid, "nccl": ops, "communicators": proc.communicators})
    return {"truth": truth, "ranks": ranks, "drops": drops}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="out")
    ap.add_argument("--gpu-sample", type=float, nargs="*", default=[],
                    help="launch-probe duty cycles to measure on the decode loop")
    ap.add_argument("--gpu-sample-period", type=float, default=1.0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"torch": validate_torch(out, args.gpu_sample, args.gpu_sample_period)}
    try:
        res["nccl"] = validate_nccl()
    except Exception as e:  # report, do not lose the torch results
        res["nccl"] = {"error": f"{type(e).__name__}: {e}"}
    (out / "gpu-validation.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str)[:6000])


if __name__ == "__main__":
    main()
