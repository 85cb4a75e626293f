"""Kernel names on a real GPU for kernels resolved before the tracer attached (run there
as root, with BCC; see bench/gpu_validate.py): how many launches get a name, from the
driver's name probes (live) or from the CUDA runtime's host stubs, and whether the
host-stub names are right.

    python3 bench/gpu_names.py OUT_DIR [--stub-names-quiet S] [--stub-names-max S]

Starts samples/gpu/torch_workload.py and sends `init` and `prep` before attaching, so
every kernel of the decode loop, the cuBLAS GEMMs, the Triton kernel and the CUDA graph
is resolved (CUDA lazy loading: at its first launch) before the tracer sees anything, as
on a server warmed up before attach. Then attaches (cuda, nccl, process), runs
`decode 200` and `suite_eager names` (under PyTorch's profiler, which names every
kernel it saw run), and reports per phase and in all: launches, launched handles, named
handles and launches by source (live / host_stub / unknown), the unnamed handles with
the most launches, the stub-naming state (window, unresolved stubs by reason, files
read, time spent) and the drop counters. In the profiled window the tracer's launches
per (demangled) name are compared with the profiler's: a host-stub name the profiler
disagrees with is a wrongly paired stub.

Writes OUT_DIR/gpu-names.json (and the capture OUT_DIR/torch-names.ttcap), prints the
JSON, and exits 1 when something is wrong (listed under "problems"): no libcudart
launch functions to probe, attach errors, lost records, no host-stub name at all,
launch counts off the profiler's, or a host-stub name the profiler contradicts. Uses
only the capture half of tokentrace (no OpenTelemetry or HTTP parsers needed).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_validate import Tracer, Workload  # noqa: E402
from tracer.correlate.gpu import GpuLedger, ProcessGpu  # noqa: E402
from tracer.events import capture, wire  # noqa: E402

HOST_STUB = wire.CONSTANTS["NAME_HOST_STUB"]
TOP = 20


def launched(ledger: GpuLedger, pid: int) -> Counter[int]:
    """Launches per handle, all threads of ``pid``, so far."""
    out: Counter[int] = Counter()
    p = ledger.processes.get(pid)
    for t in (p.threads.values() if p else ()):
        out.update(t.kernels)
    return out


def source_of(p: ProcessGpu, handle: int) -> str:
    if handle not in p.names:
        return "unknown"
    return "host_stub" if p.name_sources.get(handle) == HOST_STUB else "live"


def names_report(p: ProcessGpu, kernels: Counter[int]) -> dict[str, Any]:
    """Launches and handles by where their names came from; the top unnamed handles."""
    by = {s: {"handles": 0, "launches": 0} for s in ("live", "host_stub", "unknown")}
    for h, n in kernels.items():
        row = by[source_of(p, h)]
        row["handles"] += 1
        row["launches"] += n
    top = kernels.most_common(TOP)
    unnamed = [(h, n) for h, n in kernels.most_common() if h not in p.names]
    total = sum(kernels.values())
    return {
        "launches": total, "handles": len(kernels), **by,
        "named_launch_share": round(1 - by["unknown"]["launches"] / total, 4) if total else None,
        f"unnamed_in_top_{TOP}": sum(1 for h, _ in top if h not in p.names),
        "top_unnamed": [{"handle": f"{h:#x}", "launches": n} for h, n in unnamed[:TOP]],
    }


def demangler() -> Callable[[str], str]:
    """libstdc++'s __cxa_demangle, the one Kineto (the profiler) names kernels with."""
    lib = ctypes.CDLL("libstdc++.so.6")
    fn = lib.__cxa_demangle
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_int)]
    free = ctypes.CDLL(None).free
    free.argtypes = [ctypes.c_void_p]

    def demangle(name: str) -> str:
        if not name.startswith("_Z"):
            return name  # C names, Triton's: as they are
        status = ctypes.c_int(-1)
        ptr = fn(name.encode(), None, None, ctypes.byref(status))
        if status.value != 0 or not ptr:
            return name
        try:
            return ctypes.string_at(ptr).decode("utf-8", "replace")
        finally:
            free(ptr)

    return demangle


def compare_with_profiler(p: ProcessGpu, window: Counter[int],
                          profiler: dict[str, int]) -> dict[str, Any]:
    """The tracer's launches per demangled name in the profiled window against the
    profiler's. A name is ours only if some handle got it; unnamed launches are left
    for the profiler's names we do not have."""
    demangle = demangler()
    ours: Counter[str] = Counter()
    sources: dict[str, set[str]] = {}
    mangled: dict[str, str] = {}
    unnamed = 0
    for h, n in window.items():
        if h not in p.names:
            unnamed += n
            continue
        name = demangle(p.names[h])
        ours[name] += n
        sources.setdefault(name, set()).add(source_of(p, h))
        mangled[name] = p.names[h]
    rows = {"agree": [], "disagree": [], "tracer_only": []}
    for name, n in ours.most_common():
        theirs = profiler.get(name)
        row = {"name": name[:300], "mangled": mangled[name][:300], "tracer": n,
               "profiler": theirs, "sources": sorted(sources[name])}
        rows["agree" if theirs == n else "tracer_only" if theirs is None
             else "disagree"].append(row)
    left = {k: v for k, v in profiler.items() if k not in ours}
    bad = [r for r in rows["disagree"] + rows["tracer_only"] if "host_stub" in r["sources"]]
    return {
        "names_agree": len(rows["agree"]),
        "launches_agree": sum(r["tracer"] for r in rows["agree"]),
        "host_stub_names_agree": sum(1 for r in rows["agree"] if "host_stub" in r["sources"]),
        "disagree": rows["disagree"][:TOP],
        "tracer_only": rows["tracer_only"][:TOP],
        "host_stub_contradicted": bad[:TOP],
        "host_stub_contradicted_count": len(bad),
        "tracer_unnamed_launches": unnamed,
        "profiler_launches_we_did_not_name": sum(left.values()),
        "profiler_names_we_did_not_name": sorted(left, key=left.get, reverse=True)[:TOP],
    }


def ask(w: Workload, cmd: str) -> dict[str, Any]:
    """A workload command; its error is ours."""
    got = w.ask(cmd)
    if "error" in got:
        raise RuntimeError(f"torch_workload {cmd!r}: {got['error']}")
    return got


def run(out: Path, quiet_s: float, max_s: float) -> tuple[dict[str, Any], list[str]]:
    res: dict[str, Any] = {}
    problems: list[str] = []
    w = Workload()
    pid = w.p.pid
    try:
        res["init"] = ask(w, "init")
        res["prep"] = ask(w, "prep")  # Triton kernel and graph: resolved before attach too
        ledger = GpuLedger()
        writer = capture.CaptureWriter(out / "torch-names.ttcap",
                                       capture.new_header(command="gpu_names"))
        tr = Tracer([pid], ledger, writer, stub_names_quiet_s=quiet_s,
                    stub_names_max_s=max_s)
        gpu = tr.session.gpu
        stubs = gpu.stubs
        res["attach_seconds"] = tr.attach_s
        res["uprobes"] = {"via": gpu.uprobes.kind, "attached": gpu.uprobes.sites_attached()}
        res["attached"] = [{"kind": lib.kind, "path": lib.path, "probes": lib.probes,
                            "missing": lib.missing} for lib in gpu.attached.values()]
        res["stub_naming_at_attach"] = stubs.state()
        if not stubs.sites:
            problems.append("no libcudart launch function to probe: libcudart.so not mapped "
                            f"(attached: {[lib['path'] for lib in res['attached']]})")
        phases = {}
        for name, cmd in (("decode", "decode 200"), ("suite_eager", "suite_eager names")):
            tr.settle()
            before = launched(ledger, pid)
            reply = ask(w, cmd)
            tr.settle()
            window = launched(ledger, pid) - before
            phases[name] = {"workload": {k: v for k, v in reply.items()
                                         if k != "profiler_kernel_names"},
                            "window": window}
            if name == "suite_eager":
                phases[name]["profiler_names"] = reply["profiler_kernel_names"]
            phases[name]["stub_naming_after"] = stubs.state()
        res["attach_errors"] = dict(gpu.errors)
        drops = tr.stop()
        res["uprobes"]["detach_at_stop_s"] = round(tr.session.detach_s, 3)
        writer.close()
    finally:
        try:
            w.quit()
        except Exception as e:  # do not hide what went wrong before
            print(f"torch_workload did not quit cleanly: {e}", file=sys.stderr)
    p = ledger.processes.get(pid) or ProcessGpu(pid)
    for name, ph in phases.items():
        res[name] = {**names_report(p, ph["window"]), "workload": ph["workload"],
                     "stub_naming_after": ph["stub_naming_after"]}
    res["all"] = names_report(p, launched(ledger, pid))
    suite = phases["suite_eager"]
    res["suite_eager"]["profiler_check"] = check = compare_with_profiler(
        p, suite["window"], suite["profiler_names"])
    res["drops"] = drops

    if res["attach_errors"]:
        problems.append(f"attach errors: {res['attach_errors']}")
    for counter in ("lost_gpu", "stubs_full", "bursts_full", "kcounts_full"):
        if drops.get(counter):
            problems.append(f"drop counter {counter} = {drops[counter]}")
    if not res["all"]["launches"]:
        problems.append("no kernel launch seen at all")
    if not res["all"]["host_stub"]["handles"]:
        problems.append("no handle named by its host stub (see stub_naming_after and "
                        "drops.stub_unresolved / stub_stale)")
    seen = res["suite_eager"]["launches"]
    expected = suite["workload"]["profiler_gpu_kernels"]
    if seen != expected:
        problems.append(f"suite_eager: the tracer saw {seen} launches, the profiler "
                        f"{expected} kernels")
    if check["host_stub_contradicted_count"]:
        problems.append(f"{check['host_stub_contradicted_count']} host-stub names the "
                        "profiler contradicts (wrong stub paired, or the profiler names "
                        "kernels differently: see host_stub_contradicted)")
    res["problems"] = problems
    return res, problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="out")
    ap.add_argument("--stub-names-quiet", type=float, default=5.0, metavar="SECONDS")
    ap.add_argument("--stub-names-max", type=float, default=60.0, metavar="SECONDS")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res, problems = run(out, args.stub_names_quiet, args.stub_names_max)
    text = json.dumps(res, indent=1, default=str)
    (out / "gpu-names.json").write_text(text)
    print(text)
    if problems:
        print("\nPROBLEMS:\n  " + "\n  ".join(problems), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
