"""The live console table: one row per finished request, a summary at exit; and, every
few seconds, one GPU row per traced process that did something on the GPU since."""

from __future__ import annotations

import statistics
import sys
import time
from typing import IO, Any

from tracer.correlate.records import RequestRecord
from tracer.events import wire
from tracer.export.context import ExportContext

COLUMNS = (
    ("TIME", 12), ("PID", 7), ("TID", 7), ("REQUEST", 28), ("MODEL", 14), ("ST", 4),
    ("IN", 6), ("OUT", 6), ("TTFT", 9), ("TPOT", 9), ("DUR", 9), ("WAIT", 9), ("TLS", 5),
)
# TTFT, TPOT and DUR are the client's view (arrival at the socket to the bytes leaving);
# WAIT is the part the request's bytes waited in the socket before the server read
# them ("~" after a time: only syscall times were seen for that request); TLS is the
# protocol version of a request read through the TLS probes ("tls": version not seen),
# "-" for one in the clear


def _ms(ns: float | None) -> str:
    if ns is None:
        return "-"
    ms = ns / 1e6
    return f"{ms:.1f}ms" if ms < 1000 else f"{ms / 1000:.2f}s"


GPU_COLUMNS = (
    ("GPU", 12), ("PID", 7), ("LAUNCH/s", 9), ("LAUNCHES", 9), ("GRAPHS", 7),
    ("COPY", 8), ("SYNCS", 7), ("WAIT", 9), ("NCCL", 13), ("IBVERBS", 15), ("DEVMEM", 8),
    ("NAMED", 6),  # share of launches whose kernel has a name
)


def _short(v: float) -> str:
    return f"{v:.3g}" if v < 999.5 else f"{v:.0f}"


def _named_share(names: dict[int, str], kernels: dict[int, int]) -> str:
    """The share of launches whose kernel has a name, as "97%" ("-" with none)."""
    total = sum(kernels.values())
    if not total:
        return "-"
    return f"{100 * sum(n for h, n in kernels.items() if h in names) / total:.0f}%"


def _n(x: float) -> str:
    """A count in 4-5 characters: 950, 12.3k, 4.56M."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{_short(x / div)}{unit}"
    return f"{x:.0f}"


def _bytes(x: float) -> str:
    """Bytes in 5-6 characters: 512B, 1020KB, 3.75MB."""
    for div, unit in ((1 << 40, "T"), (1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")):
        if x >= div:
            return f"{_short(x / div)}{unit}B"
    return f"{x:.0f}B"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"


class ConsoleTable:
    """Prints requests as they finish. Plain fixed-width text: works in any terminal,
    pipe or log file."""

    def __init__(self, ctx: ExportContext, out: IO[str] | None = None) -> None:
        self.ctx = ctx
        self.out = out or sys.stdout
        self.rows = 0
        self._ttfts: list[float] = []
        self._durs: list[float] = []
        self._waits: list[float] = []
        self._syscall_timed = 0
        self._tls = 0
        self._failed = 0
        self._tokens = 0
        self.gpu: Any = None  # a tracer.correlate.gpu.GpuLedger, when GPU rows are wanted
        self.gpu_every_s = 5.0
        self._gpu_next = 0.0
        self._gpu_last: dict[int, tuple[float, int, tuple[Any, ...]]] = {}
        self._gpu_header = False

    def _line(self, cells: list[str]) -> str:
        return " ".join(_cut(c, w).ljust(w) for c, (_, w) in zip(cells, COLUMNS)).rstrip()

    def on_record(self, rec: RequestRecord) -> None:
        if self.rows == 0:
            self.out.write(self._line([name for name, _ in COLUMNS]) + "\n")
        self.rows += 1
        wall = (rec.end_ns + self.ctx.clock_offset_ns) / 1e9
        stamp = time.strftime("%H:%M:%S", time.localtime(wall)) + f".{int(wall * 1000) % 1000:03d}"
        q, r = rec.llm_request, rec.llm_response
        model = (q.model if q else None) or (r.model if r else None) or "-"
        status = str(rec.status) if rec.status is not None else "ERR"
        if rec.error:
            status = "ERR" if rec.status is None else f"{rec.status}!"
        cells = [
            stamp, str(rec.pid), str(rec.tids[0]) if rec.tids else "-",
            f"{rec.method} {rec.target.split('?', 1)[0]}", model, status,
            str(r.input_tokens) if r and r.input_tokens is not None else "-",
            str(r.output_tokens) if r and r.output_tokens is not None else "-",
            _ms(rec.client_ttft_ns), _ms(rec.client_tpot_ns),
            _ms(rec.client_end_ns - rec.client_start_ns),
            _ms(rec.socket_wait_ns) if rec.socket_timed else "~",
            (rec.tls.version or rec.tls.protocol) if rec.tls is not None else "-",
        ]
        self.out.write(self._line(cells) + "\n")
        self.out.flush()
        ttft = rec.client_ttft_ns
        if ttft is not None:
            self._ttfts.append(ttft / 1e6)
        self._durs.append((rec.client_end_ns - rec.client_start_ns) / 1e6)
        wait = rec.socket_wait_ns
        if wait is not None:
            self._waits.append(wait / 1e6)
        elif rec.net is not None:
            self._syscall_timed += 1
        self._failed += rec.failed
        self._tls += rec.tls is not None
        self._tokens += (r.output_tokens or 0) if r else 0

    def gpu_tick(self, now: float | None = None) -> None:
        """Print a GPU row for each process whose totals changed since the last row
        (call often; prints every ``gpu_every_s``). Totals since tracing started; the
        rate is since the previous row. Launch counts are as seen (--gpu-sample: the
        summary file has the estimates)."""
        now = time.monotonic() if now is None else now
        if self.gpu is None or self.gpu_every_s <= 0 or now < self._gpu_next:
            return
        self._gpu_next = now + self.gpu_every_s
        stamp = time.strftime("%H:%M:%S")
        for p, t in self.gpu.totals():
            v = t.verbs
            state = (t.kernel_launches, t.graph_launches, t.sync_calls, sum(t.memcpy_bytes.values()),
                     sum(t.nccl_ops.values()), sum(v.wrs.values()), sum(v.completions.values()),
                     p.live_bytes)
            last = self._gpu_last.get(p.pid)
            self._gpu_last[p.pid] = (now, t.kernel_launches, state)
            if last is not None and last[2] == state:
                continue
            rate = ((t.kernel_launches - last[1]) / (now - last[0])
                    if last is not None and now > last[0] else None)
            if not self._gpu_header:
                self._gpu_header = True
                self.out.write(" ".join(n.ljust(w) for n, w in GPU_COLUMNS).rstrip() + "\n")
            nccl = (f"{_n(sum(t.nccl_ops.values()))}/{_bytes(sum(t.nccl_bytes.values()))}"
                    if t.nccl_ops else "-")
            ibv = (f"{_n(sum(v.wrs.values()))}/{_bytes(sum(v.wr_bytes.values()))}"
                   + (f" E{_n(v.completion_errors)}" if v.completion_errors else "")
                   if v.wrs or v.completions else "-")
            cells = [stamp, str(p.pid), _n(rate) if rate is not None else "-",
                     _n(t.kernel_launches), _n(t.graph_launches),
                     _bytes(sum(t.memcpy_bytes.values())), _n(t.sync_calls),
                     _ms(t.sync_wait_ns), nccl, ibv, _bytes(p.live_bytes),
                     _named_share(p.names, t.kernels)]
            self.out.write(" ".join(_cut(c, w).ljust(w)
                                    for c, (_, w) in zip(cells, GPU_COLUMNS)).rstrip() + "\n")
        self.out.flush()

    def summary(self) -> str:
        if not self.rows:
            return "no requests seen"
        parts = [f"{self.rows} requests", f"{self._failed} failed",
                 f"{self._tokens} output tokens"]
        if self._ttfts:
            q = statistics.quantiles(self._ttfts, n=10) if len(self._ttfts) > 1 else [self._ttfts[0]] * 9
            parts.append(f"TTFT p50 {statistics.median(self._ttfts):.1f}ms p90 {q[8]:.1f}ms")
        parts.append(f"duration p50 {statistics.median(self._durs):.1f}ms")
        if self._waits:
            parts.append(f"socket wait p50 {statistics.median(self._waits):.1f}ms "
                         f"max {max(self._waits):.1f}ms")
        if self._syscall_timed:
            parts.append(f"{self._syscall_timed} timed by syscalls only")
        if self._tls:
            parts.append(f"{self._tls} over TLS")
        return ", ".join(parts)

    def close(self) -> None:
        self.out.flush()


LARGEST_RECORD = 8 + max(r.size for r in wire.RECORDS.values())  # with its ring header


def ring_at_loss_text(rep: dict[str, Any]) -> str:
    """``; records were lost with the ring full (...)``, or with room in it, and how
    many the kernel refused only after spinning on the ring's lock, from the counters
    (``ring_fill_at_loss_bytes``: tracer/probes/session.py; ``ring_refused_*``:
    bpf/common.h); empty when nothing was lost."""
    fill = rep.get("capture.ring_fill_at_loss_bytes")
    size = rep.get("capture.ring_bytes")
    slow = rep.get("capture.ring_refused_slow", 0)
    saved = rep.get("capture.ring_retry_saved", 0)
    again = (f"; {saved} records the ring refused at once were taken at a second try"
             if saved else "")
    lock = ""
    if slow:
        spun = rep.get("capture.ring_refused_ns", 0) / 1e6
        lock = f"; {slow} refused after spinning on the ring's lock, {spun:.1f} ms in refused calls"
    if fill is None or not size:
        return (f"; records lost{lock}" if slow else "") + again
    held = f"the ring held {_bytes(fill)} of {_bytes(size)}"
    if fill > size - LARGEST_RECORD:
        return (f"; records were lost with the ring full ({held}: the agent fell behind; "
                f"--ringbuf-mb{lock})" + again)
    return (f"; records were lost with room in the ring ({held}{lock}: the kernel refused "
            f"a reservation, not for want of room)" + again)


def probe_cost_text(rep: dict[str, Any]) -> str:
    """``probes: an estimated ...% of the traced processes' CPU ...``: the overhead
    meter's last and largest estimates (tracer/overhead.py) and what ``--max-overhead``
    did; empty when nothing was measured."""
    n = rep.get("capture.probe_cpu_estimates", 0)
    if rep.get("capture.probe_cpu_unmeasured"):
        return ("probes' cost not measured: the kernel's BPF run-time statistics need "
                "CAP_SYS_ADMIN or the sysctl kernel.bpf_stats_enabled=1")
    if not n:
        return ""
    last = rep.get("capture.probe_cpu_ppm", 0) / 1e4
    top = rep.get("capture.probe_cpu_ppm_max", 0) / 1e4
    probe, traced = rep.get("capture.probe_cpu_probe_ns", 0), rep.get("capture.probe_cpu_traced_ns", 0)
    over = f", {probe / traced:.2%} over all of them" if traced else ""
    host = rep.get("capture.probe_cpu_host_probe_ns", 0)
    others = (f"; {host / traced:.2%} with the runs in other processes"
              if traced and host > probe else "")
    text = (f"probes: an estimated {last:.2f}% of the traced processes' CPU at the last of "
            f"{n} measurements ({top:.2f}% at most{over}{others}; the probes' kernel time "
            f"in the traced processes against their CPU)")
    changes = rep.get("capture.overhead_budget_changes", 0)
    if changes:
        share = rep.get("capture.overhead_budget_fraction_pct", 100)
        text += (f"; --max-overhead changed the share traced {changes} times, "
                 f"{'to all the time' if share >= 100 else f'to {share}% of the time'} last")
    return text


def skipped_runs_text(rep: dict[str, Any]) -> str:
    """``; the kernel skipped N probe runs (...)``: runs of programs the kernel did not
    make while another BPF program ran on that CPU (``bpfstats.missed_runs``), and
    what the agent knows they cost; empty when there were none."""
    n = rep.get("capture.probe_runs_missed", 0)
    if not n:
        return ""
    pre = "capture.probe_runs_missed."
    which = ", ".join(f"{k[len(pre):]}={v}" for k, v in sorted(rep.items()) if k.startswith(pre))
    unknown = rep.get("net_timing.departure_unknown", 0)
    return (f"; the kernel skipped {n} probe runs while another BPF program ran on the CPU "
            f"({which})" + (f", {unknown} requests' departures bounded, not timed"
                            if unknown else ""))
