"""The report's reconciliation: the GPU time the tracer observed, priced, against the
per-request costs in the span file and the unattributed and idle rest, by process.

Its input is the ``reconciliation`` of ``run/replay --summary`` (``Ledger`` and
``cost.reconcile``). For each GPU process over its window (first to last GPU
activity): window = busy + idle, busy = charged to requests + unattributed; priced at
the span file's price (or the report's ``--gpu-price``/``--gpu-model``). The per-request
costs of the span file are summed for the same process, so the table shows whether
they add up to what the GPU was used for: ``balance`` is window cost minus requests,
unattributed and idle, zero when everything reconciles.
"""

from __future__ import annotations

import json
from typing import Any

RECON_COLUMNS: dict[str, str] = {
    "pid": "GPU process id",
    "gpu_model": "GPU model the price is for",
    "price_per_gpu_hour": "USD per GPU-hour",
    "window_s": "first to last GPU activity of each launching thread, summed (the wall window when one thread launches), s",
    "streams": "threads that launched GPU work",
    "busy_s": "GPU time observed: engine steps and bursts, first launch to end of wait, s",
    "charged_s": "of it, charged to requests, s",
    "unattributed_s": "of it, in no traced request (warm-up, idle steps, untraced), s",
    "idle_s": "window minus busy, s",
    "window_usd": "window x price",
    "requests_usd": "sum of the cost of this process's requests in the span file",
    "unattributed_usd": "unattributed x price",
    "idle_usd": "idle x price",
    "balance_usd": "window - requests - unattributed - idle (0: it reconciles)",
    "launches_observed": "kernel launches the probes saw in the process",
    "launches_charged": "of them, charged to requests",
    "launches_unattributed": "of them, in no request",
}


class SummaryError(ValueError):
    """The --summary file cannot be used."""


def load_summary(path: str) -> dict[str, Any]:
    """The ``reconciliation`` object of a ``--summary`` file."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SummaryError(f"cannot read {path}: {e}") from e
    recon = doc.get("reconciliation") if isinstance(doc, dict) else None
    if not isinstance(recon, dict) or not isinstance(recon.get("cost"), dict):
        raise SummaryError(f"{path} has no GPU reconciliation (write it with "
                           "`tokentrace run/replay --summary`)")
    return recon


def reconcile_rows(recon: dict[str, Any], rows: list[dict[str, Any]],
                   price: float | None = None, model: str | None = None
                   ) -> list[dict[str, Any]]:
    """One row per GPU process (``RECON_COLUMNS``). ``price``: reprice everything."""
    out = []
    requests_usd: dict[int, float] = {}
    for r in rows:
        if r.get("pid") is not None and r.get("cost_usd") is not None:
            requests_usd[int(r["pid"])] = requests_usd.get(int(r["pid"]), 0.0) + r["cost_usd"]
    for p in recon["cost"].get("processes", []):
        if not isinstance(p, dict):
            continue
        usd = price if price is not None else p.get("price_per_gpu_hour")
        row = {c: p.get(c) for c in RECON_COLUMNS}
        row["price_per_gpu_hour"] = usd
        row["gpu_model"] = model or p.get("gpu_model")
        # the span file's requests may have been served by the API process in front
        # of this GPU process: count those too when this is the only GPU process
        pid = p.get("pid")
        req = requests_usd.get(pid)
        if req is None and len(recon["cost"]["processes"]) == 1:
            req = sum(requests_usd.values()) if requests_usd else None
        if usd is not None:
            for k in ("window", "unattributed", "idle"):
                row[f"{k}_usd"] = round((p.get(f"{k}_s") or 0.0) / 3600 * usd, 9)
            if price is not None and req is not None:
                req = round((p.get("charged_s") or 0.0) / 3600 * usd, 9)
            row["requests_usd"] = req
            if req is not None:
                row["balance_usd"] = round(row["window_usd"] - req - row["unattributed_usd"]
                                           - row["idle_usd"], 9)
        out.append(row)
    return out
