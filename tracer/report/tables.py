"""CSV and JSON files of the report: requests, and the summaries by model and tenant."""

from __future__ import annotations

import csv
import json
import os
from typing import Any

from tracer.report.rows import COLUMNS
from tracer.report.summary import SUMMARY_COLUMNS


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str) and v.startswith(_FORMULA_START):
        # labels such as the model name come from clients: a spreadsheet must not run
        # them as formulas (OWASP "CSV injection")
        return "'" + v
    return v


def write_csv(path: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    """``rows`` as CSV with a header; a missing value is an empty cell."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow([_cell(r.get(c)) for c in columns])


def write_json(path: str, doc: Any) -> None:
    """``doc`` as indented JSON (a missing value is ``null``)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def write_tables(out_dir: str, rows: list[dict[str, Any]], by_model: list[dict[str, Any]],
                 by_tenant: list[dict[str, Any]], totals: dict[str, Any],
                 meta: dict[str, Any], formats: set[str]) -> list[str]:
    """Write the CSV and/or JSON files asked for; returns their paths."""
    written = []
    if "csv" in formats:
        for name, data, cols in (
                ("requests.csv", rows, list(COLUMNS)),
                ("by_model.csv", by_model, ["model", *SUMMARY_COLUMNS]),
                ("by_tenant.csv", by_tenant, ["tenant", *SUMMARY_COLUMNS])):
            path = os.path.join(out_dir, name)
            write_csv(path, data, cols)
            written.append(path)
    if "json" in formats:
        path = os.path.join(out_dir, "requests.json")
        write_json(path, [{c: r.get(c) for c in COLUMNS} for r in rows])
        written.append(path)
        path = os.path.join(out_dir, "summary.json")
        write_json(path, {**meta, "totals": totals, "by_model": by_model,
                          "by_tenant": by_tenant})
        written.append(path)
    return written
