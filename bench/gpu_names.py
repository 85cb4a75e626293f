"""Kernel names on a real GPU for kernels resolved before the tracer attached (run there
as root, with BCC; see bench/gpu_validate.py): how many launches get a name and from
where (live: the driver's name probes; host_stub / registered_stub: the runtime's host
stub; stub_slot: the handle a CUDA 13 host stub keeps, read from memory; driver_object:
the driver's object behind the handle, confirmed by a cubin, or driver_string: by a
library's string), whether those names are right, and what naming cost at attach.

    python3 bench/gpu_names.py OUT_DIR [--hf] [--stub-names-quiet S] [--stub-names-max S]

Starts samples/gpu/torch_workload.py and sends `init` and `prep` (and `hf_prep` with
--hf) before attaching, so every kernel of the decode loop, the cuBLAS GEMMs, the Triton
kernel, the CUDA graph (and HF generate) is resolved (CUDA lazy loading: at its first
launch) before the tracer sees anything, as on a server warmed up before attach. Then
attaches (cuda, nccl, process), waits for the names found at attach, runs `decode 200`,
`suite_eager names` (and `suite_hf names`) under PyTorch's profiler, which names every
kernel it saw run, and reports per phase: launches, handles and launches by name
source, the share of launches named, the unnamed handles with the most launches, and,
in the profiled windows, the tracer's launches per (demangled) name against the
profiler's, its top 10 against the profiler's top 10. The cost of naming at attach is
measured per CUDA library of the workload in a fresh process (seconds, CPU, peak
memory), and the driver-object layout learnt is reported with what it found.

Writes OUT_DIR/gpu-names.json (and the capture OUT_DIR/torch-names.ttcap), prints the
JSON, and exits 1 when something is wrong (listed under "problems"): attach errors,
lost records, launch counts off the profiler's, a name the profiler contradicts, less
than 95% of a profiled window's launches named, or a top 10 unlike the profiler's. Uses
only the capture half of tokentrace (no OpenTelemetry or HTTP parsers needed).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_validate import Tracer, Workload, launched  # noqa: E402
from tracer.correlate.gpu import NAME_ROWS, GpuLedger, ProcessGpu, name_row  # noqa: E402
from tracer.events import capture  # noqa: E402

TOP = 20
PRE_ATTACH = ("host_stub", "registered_stub", "stub_slot", "driver_object", "driver_string")
CUDA_LIB = ("libtorch_cuda", "libcublas", "libcudnn", "libnccl", "libcusparse", "libcufft",
            "libcurand", "libcusolver", "libc10_cuda", "flash_attn", "libcudart")


def source_of(p: ProcessGpu, handle: int) -> str:
    """The kernel_names row of ``handle``'s name."""
    return name_row(p.name_sources.get(handle) if handle in p.names else None)


def names_report(p: ProcessGpu, kernels: Counter[int]) -> dict[str, Any]:
    """Launches and handles by where their names came from; the top unnamed handles."""
    by = {s: {"handles": 0, "launches": 0} for s in NAME_ROWS}
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


def top10(counts: dict[str, int]) -> list[tuple[str, int]]:
    """The 10 names with most launches, ties broken by name."""
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:10]


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
    rows: dict[str, list[dict[str, Any]]] = {"agree": [], "disagree": [], "tracer_only": []}
    for name, n in ours.most_common():
        theirs = profiler.get(name)
        row = {"name": name[:300], "mangled": mangled[name][:300], "tracer": n,
               "profiler": theirs, "sources": sorted(sources[name])}
        rows["agree" if theirs == n else "tracer_only" if theirs is None
             else "disagree"].append(row)
    left = {k: v for k, v in profiler.items() if k not in ours}
    bad = [r for r in rows["disagree"] + rows["tracer_only"]
           if set(r["sources"]) & set(PRE_ATTACH)]
    ours_top, theirs_top = top10(dict(ours)), top10(profiler)
    return {
        "names_agree": len(rows["agree"]),
        "launches_agree": sum(r["tracer"] for r in rows["agree"]),
        "agree_by_source": dict(Counter(s for r in rows["agree"] for s in r["sources"])),
        "disagree": rows["disagree"][:TOP],
        "tracer_only": rows["tracer_only"][:TOP],
        "pre_attach_contradicted": bad[:TOP],
        "pre_attach_contradicted_count": len(bad),
        "tracer_unnamed_launches": unnamed,
        "profiler_launches_we_did_not_name": sum(left.values()),
        "profiler_names_we_did_not_name": sorted(left, key=left.get, reverse=True)[:TOP],
        "top10_equal": ours_top == theirs_top,
        "top10_tracer": [[n[:160], c] for n, c in ours_top],
        "top10_profiler": [[n[:160], c] for n, c in theirs_top],
    }


def ask(w: Workload, cmd: str) -> dict[str, Any]:
    """A workload command; its error is ours."""
    got = w.ask(cmd)
    if "error" in got:
        raise RuntimeError(f"torch_workload {cmd!r}: {got['error']}")
    return got


def attach_cost(paths: list[str]) -> list[dict[str, Any]]:
    """What naming before attach costs per library, each in a fresh Python (so that
    memory is the library's alone): wall and CPU seconds, peak RSS and anonymous
    memory, names and handle variables found."""
    code = (
        "import json, os, resource, sys, time\n"
        "from tracer.probes.prenames import PreNames, device_arch\n"
        "def mem():\n"
        "    f = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)\n"
        "    return {k: int(f[k].split()[0]) // 1024 for k in ('VmRSS', 'RssAnon', 'RssFile')}\n"
        "m0 = mem(); c0 = time.process_time(); t0 = time.perf_counter()\n"
        "ev = PreNames(device_arch()).evidence(sys.argv[1])\n"
        "out = {'wall_s': round(time.perf_counter() - t0, 3),\n"
        "       'cpu_s': round(time.process_time() - c0, 3), 'mb_before': m0, 'mb_after': mem(),\n"
        "       'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,\n"
        "       'file_mb': round(os.path.getsize(sys.argv[1]) / 1e6, 1),\n"
        "       'evidence': ev.summary() if ev else None}\n"
        "print(json.dumps(out))\n")
    out = []
    for path in paths:
        r = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                           cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                               filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))))
        try:
            out.append(json.loads(r.stdout.strip().splitlines()[-1]))
        except (IndexError, json.JSONDecodeError):
            out.append({"path": path, "error": (r.stderr or r.stdout)[-2000:]})
    return out


def diagnose(gpu: Any, pid: int, p: ProcessGpu, kernels: Counter[int]) -> dict[str, Any]:
    """What the driver's objects hold: for a few named handles the paths that lead to
    their names, and for the unnamed handles with the most launches every string found
    near them that is a kernel of the loaded cubins."""
    from tracer.probes.prenames import ProcessMemory, explore

    names = gpu.prenames.names
    proc = names._procs.get(pid)
    known = proc.kernel_names if proc else set()
    mem = ProcessMemory(pid)
    out: dict[str, Any] = {"kernel_names_known": len(known), "named": [], "unnamed": []}
    try:
        for h, _n in kernels.most_common():
            if h in p.names and len(out["named"]) < 4:
                hits = explore(mem, h)
                out["named"].append({
                    "handle": f"{h:#x}", "source": source_of(p, h), "name": p.names[h][:160],
                    "paths_to_it": [list(k) for k, v in hits.items() if v == p.names[h]][:8],
                    "strings": len(hits)})
            elif h not in p.names and len(out["unnamed"]) < 8:
                hits = explore(mem, h)
                out["unnamed"].append({
                    "handle": f"{h:#x}", "launches": kernels[h], "strings": len(hits),
                    "kernel_names": [[list(k), v[:160]] for k, v in hits.items()
                                     if v in known][:8],
                    "sample": [[list(k), v[:80]] for k, v in list(hits.items())[:6]]})
    finally:
        mem.close()
    return out


def run(out: Path, quiet_s: float, max_s: float, hf: bool) -> tuple[dict[str, Any], list[str]]:
    res: dict[str, Any] = {}
    problems: list[str] = []
    w = Workload()
    pid = w.p.pid
    windows = [("decode", "decode 200", False), ("suite_eager", "suite_eager names", True)]
    try:
        res["init"] = ask(w, "init")
        res["prep"] = ask(w, "prep")  # Triton kernel, graph, GEMMs: resolved before attach
        if hf:
            res["hf_prep"] = ask(w, "hf_prep")
            windows.append(("suite_hf", "suite_hf names", True))
        ledger = GpuLedger()
        writer = capture.CaptureWriter(out / "torch-names.ttcap",
                                       capture.new_header(command="gpu_names"))
        t0 = time.perf_counter()
        tr = Tracer([pid], ledger, writer, stub_names_quiet_s=quiet_s,
                    stub_names_max_s=max_s)
        gpu = tr.session.gpu
        res["attach_seconds"] = tr.attach_s
        idle = gpu.prenames.wait_idle(120) if gpu.prenames else True
        res["names_at_attach_seconds"] = round(time.perf_counter() - t0, 3)
        if not idle:
            problems.append("naming at attach did not finish in 120 s")
        res["uprobes"] = {"via": gpu.uprobes.kind, "attached": gpu.uprobes.sites_attached()}
        res["attached"] = [{"kind": lib.kind, "path": lib.path, "probes": lib.probes,
                            "missing": lib.missing} for lib in gpu.attached.values()]
        res["naming_at_attach"] = gpu.stubs.state()
        phases = {}
        for name, cmd, _profiled in windows:
            tr.settle()
            before = launched(ledger, pid, tr.open_bursts(pid))
            reply = ask(w, cmd)
            tr.settle()
            if gpu.prenames:
                gpu.prenames.wait_idle(30)
            tr.settle()
            window = launched(ledger, pid, tr.open_bursts(pid)) - before
            phases[name] = {"workload": {k: v for k, v in reply.items()
                                         if k != "profiler_kernel_names"},
                            "window": window,
                            "profiler_names": reply.get("profiler_kernel_names")}
        res["attach_errors"] = dict(gpu.errors)
        p = ledger.processes.get(pid) or ProcessGpu(pid)
        res["driver_object_diagnostics"] = diagnose(gpu, pid, p, launched(ledger, pid))
        res["naming_after"] = gpu.stubs.state()
        libs = sorted({m.split()[-1] for m in open(f"/proc/{pid}/maps")
                       if any(k in m for k in CUDA_LIB) and m.split()[-1].startswith("/")})
        drops = tr.stop()
        res["uprobes"]["detach_at_stop_s"] = round(tr.session.detach_s, 3)
        writer.close()
    finally:
        try:
            w.quit()
        except Exception as e:  # do not hide what went wrong before
            print(f"torch_workload did not quit cleanly: {e}", file=sys.stderr)
    res["attach_cost"] = attach_cost(libs)
    p = ledger.processes.get(pid) or ProcessGpu(pid)
    for name, ph in phases.items():
        res[name] = {**names_report(p, ph["window"]), "workload": ph["workload"]}
        if ph["profiler_names"] is not None:
            res[name]["profiler_check"] = check = compare_with_profiler(
                p, ph["window"], ph["profiler_names"])
            seen, expected = res[name]["launches"], ph["workload"]["profiler_gpu_kernels"]
            if seen != expected:
                problems.append(f"{name}: the tracer saw {seen} launches, the profiler "
                                f"{expected} kernels")
            if check["pre_attach_contradicted_count"]:
                problems.append(f"{name}: {check['pre_attach_contradicted_count']} names "
                                "found before attach that the profiler contradicts")
            if (res[name]["named_launch_share"] or 0) < 0.95:
                problems.append(f"{name}: {res[name]['named_launch_share']} of launches named")
            if not check["top10_equal"]:
                problems.append(f"{name}: top 10 kernels differ from the profiler's")
    res["all"] = names_report(p, launched(ledger, pid))
    res["drops"] = drops
    if res["attach_errors"]:
        problems.append(f"attach errors: {res['attach_errors']}")
    for counter in ("lost_gpu", "stubs_full", "bursts_full", "kcounts_full"):
        if drops.get(counter):
            problems.append(f"drop counter {counter} = {drops[counter]}")
    if not res["all"]["launches"]:
        problems.append("no kernel launch seen at all")
    res["problems"] = problems
    return res, problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="out")
    ap.add_argument("--hf", action="store_true", help="also a tiny Llama's HF generate")
    ap.add_argument("--stub-names-quiet", type=float, default=5.0, metavar="SECONDS")
    ap.add_argument("--stub-names-max", type=float, default=60.0, metavar="SECONDS")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res, problems = run(out, args.stub_names_quiet, args.stub_names_max, args.hf)
    text = json.dumps(res, indent=1, default=str)
    (out / "gpu-names.json").write_text(text)
    print(json.dumps({k: res.get(k) for k in ("problems", "all")}, indent=1, default=str))
    if problems:
        print("\nPROBLEMS:\n  " + "\n  ".join(problems), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
