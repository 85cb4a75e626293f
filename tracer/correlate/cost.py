"""What GPU time costs: the GPU model (from NVML), a price per GPU-hour, and USD.

The correlator estimates each request's GPU time in milliseconds; this module turns it
into money. The price comes, in this order, from an explicit ``price`` (what the user
pays), the default table below for an explicit ``model``, the default for the model
NVML reports, or ``FALLBACK_USD_PER_GPU_HOUR`` with the reason the model is unknown.

Everything here is a pure function except ``detect_gpu_model``, which asks NVML
through ``pynvml`` (the ``nvidia-ml-py`` package) and never raises: on a host without
an NVIDIA driver it returns no name and says why.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

MS_PER_HOUR = 3_600_000.0


@dataclass(frozen=True)
class GpuPrice:
    """A default on-demand price for one GPU model."""

    key: str  # short id, accepted as --gpu-model ("h100-sxm")
    name: str  # human name ("NVIDIA H100 SXM")
    usd_per_hour: float  # one GPU, one hour
    pattern: str  # regex over the normalised NVML name (upper case, '-'/'_' as spaces)


# On-demand prices for ONE GPU, in USD per hour, rounded. A sensible starting point,
# not anyone's bill: providers differ by 2x and change prices often, and reserved or
# spot capacity costs far less. Pass the price you actually pay (--gpu-price).
# Where the numbers come from (public list prices as quoted in May-June 2026 price
# surveys, not re-checked against the vendors since):
#   Lambda on-demand: H100 SXM 3.78, H100 PCIe 2.86, A100 40GB 1.48, A10 0.86.
#   Modal per-second rates: A100 80GB 2.50, L40S 1.95, L4 0.80, T4 0.59.
#   AWS EC2 us-east-1, one-GPU instances (GPU + its CPUs and memory): g5.xlarge
#   (A10G) 1.006, g4dn.xlarge (T4) 0.526, g6e.xlarge (L40S) about 1.86.
#   B200, GB200, GH200, H200, H100 NVL, H800, L40, V100: our estimates between the
#   neoclouds' list prices; check them before relying on them.
# Patterns are tried in order: the more specific name first (H100 PCIe before H100).
DEFAULT_PRICES: tuple[GpuPrice, ...] = (
    GpuPrice("gb200", "NVIDIA GB200", 6.50, r"\bGB200\b"),
    GpuPrice("b200", "NVIDIA B200", 5.99, r"\bB200\b"),
    GpuPrice("gh200", "NVIDIA GH200", 3.99, r"\bGH200\b"),
    GpuPrice("h200", "NVIDIA H200", 3.95, r"\bH200\b"),
    GpuPrice("h100-pcie", "NVIDIA H100 PCIe", 2.86, r"\bH100\b.*\bPCIE\b"),
    GpuPrice("h100-nvl", "NVIDIA H100 NVL", 3.20, r"\bH100\b.*\bNVL\b"),
    # NVML calls the SXM5 part "NVIDIA H100 80GB HBM3"
    GpuPrice("h100-sxm", "NVIDIA H100 SXM", 3.78, r"\bH100\b"),
    GpuPrice("h800", "NVIDIA H800", 3.78, r"\bH800\b"),
    GpuPrice("a100-80gb", "NVIDIA A100 80GB", 2.50, r"\bA100\b.*\b80\s?GB\b"),
    GpuPrice("a100-40gb", "NVIDIA A100 40GB", 1.48, r"\bA100\b"),
    GpuPrice("l40s", "NVIDIA L40S", 1.86, r"\bL40S\b"),
    GpuPrice("l40", "NVIDIA L40", 1.50, r"\bL40\b"),
    GpuPrice("l4", "NVIDIA L4", 0.80, r"\bL4\b"),
    GpuPrice("a10g", "NVIDIA A10G", 1.01, r"\bA10G\b"),
    GpuPrice("a10", "NVIDIA A10", 0.86, r"\bA10\b"),
    GpuPrice("t4", "NVIDIA T4", 0.53, r"\bT4\b"),
    GpuPrice("v100", "NVIDIA V100", 3.06, r"\bV100\b"),
)

# An unknown GPU is priced like a mid-range data-centre GPU (between L40S and A100
# 80GB above), and the span says the price was a fallback.
FALLBACK_USD_PER_GPU_HOUR = 2.00

_COMPILED = tuple((p, re.compile(p.pattern)) for p in DEFAULT_PRICES)
_BY_KEY = {p.key: p for p in DEFAULT_PRICES}


def _normalise(name: str) -> str:
    return re.sub(r"[-_/]+", " ", name.strip().upper())


def match_model(name: str | None) -> GpuPrice | None:
    """The table entry for a GPU name: an NVML name ("NVIDIA A100-SXM4-80GB"), a table
    key ("a100-80gb") or a loose spelling ("H100 PCIe"); None when nothing matches."""
    if not name or not name.strip():
        return None
    key = name.strip().lower()
    if key in _BY_KEY:
        return _BY_KEY[key]
    norm = _normalise(name)
    for entry, rx in _COMPILED:
        if rx.search(norm):
            return entry
    return None


@dataclass(frozen=True)
class GpuDetection:
    """What NVML said: every device's name, or why there are none."""

    names: tuple[str, ...] = ()
    reason: str | None = None  # set when NVML could not be asked or found no device

    @property
    def name(self) -> str | None:
        """The most common model on this host (all devices, when there is only one)."""
        if not self.names:
            return None
        return Counter(self.names).most_common(1)[0][0]


def detect_gpu_model() -> GpuDetection:
    """Ask NVML for the GPU names of this host. Never raises: a missing package, a
    missing ``libnvidia-ml.so.1`` or a driver error comes back as ``reason``."""
    try:
        import pynvml
    except ImportError as e:
        return GpuDetection(reason=f"nvidia-ml-py (pynvml) is not installed: {e}")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return GpuDetection(reason="NVML library libnvidia-ml.so.1 not found "
                                   "(no NVIDIA driver on this host)")
    except pynvml.NVMLError as e:
        return GpuDetection(reason=f"NVML init failed: {e}")
    except OSError as e:
        return GpuDetection(reason=f"NVML could not be loaded: {e}")
    try:
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            n = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(n.decode(errors="replace") if isinstance(n, bytes) else str(n))
    except pynvml.NVMLError as e:
        return GpuDetection(reason=f"NVML query failed: {e}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    if not names:
        return GpuDetection(reason="NVML found no GPU")
    distinct = sorted(set(names))
    reason = None if len(distinct) == 1 else f"mixed GPU models: {', '.join(distinct)}"
    return GpuDetection(tuple(names), reason)


def cost_usd(gpu_ms: float, price_per_hour: float) -> float:
    """USD for ``gpu_ms`` milliseconds of one GPU at ``price_per_hour`` USD per GPU-hour."""
    for what, v in (("GPU time", gpu_ms), ("price per GPU-hour", price_per_hour)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v < 0:
            raise ValueError(f"{what} must be a finite number >= 0, got {v!r}")
    return gpu_ms / MS_PER_HOUR * price_per_hour


@dataclass(frozen=True)
class GpuPricing:
    """The price the correlator charges GPU time at, and where it came from.

    Build it once with ``GpuPricing.resolve(...)``; ``attributes(gpu_ms)`` gives the
    ``tokentrace.*`` suffixes to add to a request record's ``gpu`` dict.
    """

    usd_per_gpu_hour: float
    model: str | None = None  # the GPU model name as NVML or the user gave it
    source: str = "fallback"  # "explicit", "default:<key>" or "fallback"
    notes: tuple[str, ...] = field(default=())  # why a default could not be used

    @classmethod
    def resolve(cls, price: float | None = None, model: str | None = None,
                detect: Callable[[], GpuDetection] = detect_gpu_model) -> "GpuPricing":
        """Choose the price: ``price`` if given, else the default for ``model`` if
        given, else the default for the model NVML reports, else the fallback.
        ``detect`` is only called when no ``model`` is given."""
        notes: list[str] = []
        if model is None:
            found = detect()
            model = found.name
            if found.reason:
                notes.append(found.reason)
        if price is not None:
            cost_usd(0.0, price)  # validates
            return cls(float(price), model, "explicit", tuple(notes))
        entry = match_model(model)
        if entry is not None:
            return cls(entry.usd_per_hour, model, f"default:{entry.key}", tuple(notes))
        if model:
            notes.append(f"no default price for GPU model {model!r}")
        return cls(FALLBACK_USD_PER_GPU_HOUR, model, "fallback", tuple(notes))

    def cost_usd(self, gpu_ms: float) -> float:
        """USD for ``gpu_ms`` milliseconds of GPU time at this price."""
        return cost_usd(gpu_ms, self.usd_per_gpu_hour)

    def attributes(self, gpu_ms: float | None) -> dict[str, Any]:
        """``tokentrace.<suffix>`` -> value for a request that used ``gpu_ms`` (cost is
        left out when the GPU time is unknown, never set to zero)."""
        out: dict[str, Any] = {"cost.price_per_gpu_hour": self.usd_per_gpu_hour,
                               "cost.price_source": self.source}
        if self.model:
            out["gpu.model"] = self.model
        if gpu_ms is not None:
            out["cost.usd"] = round(self.cost_usd(gpu_ms), 9)
        return out

    def describe(self) -> str:
        """One line for the log: the price, the model and why."""
        what = f"${self.usd_per_gpu_hour:.2f}/GPU-hour ({self.source}"
        what += f", {self.model})" if self.model else ")"
        return what + ("; " + "; ".join(self.notes) if self.notes else "")


class Window(NamedTuple):
    """A GPU process's activity: first and last GPU activity (ns) of any thread, and
    the sum over its launching threads of each one's own first-to-last (``stream_ns``)."""

    first: int
    last: int
    stream_ns: int
    streams: int


def reconcile(recon: dict[str, Any], windows: dict[int, Window],
              pricing: "GpuPricing | None") -> dict[str, Any]:
    """Money that reconciles, per GPU process (OpenCost's habit: every dollar of the
    window lands in a request, in busy-but-unattributed, or in idle).

    ``recon`` is ``Ledger.reconciliation()``; ``windows`` each process's ``Window``. GPU
    time is the steps' and bursts' spans (first launch to the end of the wait) on each
    launching thread, so busy <= that thread's window. The window priced is the stream
    time: on an engine with one launching thread (every engine measured) it is the
    wall window; a process whose threads keep the GPU busy at once (concurrent
    streams) gets each thread's window, and ``wall_s`` and ``streams`` say so. Costs
    are at ``pricing``'s price per GPU-hour, one GPU per process."""
    price = pricing.usd_per_gpu_hour if pricing is not None else None
    rows = []
    for pid, q in recon.get("processes", {}).items():
        t = q.get("gpu_time_ns", {})
        w = windows.get(int(pid), Window(0, 0, 0, 0))
        window_s = w.stream_ns / 1e9
        busy_s = t.get("observed", 0.0) / 1e9
        row: dict[str, Any] = {
            "pid": int(pid), "window_s": round(window_s, 6), "busy_s": round(busy_s, 6),
            "wall_s": round(max(0, w.last - w.first) / 1e9, 6), "streams": w.streams,
            "charged_s": round(t.get("charged", 0.0) / 1e9, 6),
            "unattributed_s": round(t.get("unattributed", 0.0) / 1e9, 6),
            "idle_s": round(max(0.0, window_s - busy_s), 6),
            "launches_observed": q.get("kernel_launches", {}).get("observed", 0.0),
            "launches_charged": q.get("kernel_launches", {}).get("charged", 0.0),
            "launches_unattributed": q.get("kernel_launches", {}).get("unattributed", 0.0),
        }
        if price is not None:
            for k in ("window", "busy", "charged", "unattributed", "idle"):
                row[f"{k}_usd"] = round(row[f"{k}_s"] / 3600 * price, 9)
            row["price_per_gpu_hour"] = price
            row["gpu_model"] = pricing.model if pricing is not None else None
        rows.append(row)
    return {"balanced": recon.get("balanced", True), "processes": rows}
