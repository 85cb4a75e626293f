"""How long the agent takes to compile its BPF program and to attach, against another
checkout, in one run.

    python bench/compile_time.py [--against PATH] [--rounds 6] [--out FILE]

Each round runs, in a fresh process per checkout and in alternating order:

- ``compile``: BCC's compile of every concern (``bpf_module_create_c_from_string``: its
  three clang passes and LLVM), nothing loaded;
- ``program``: ``tracer.probes.loader.compile_program`` (the compile, then every
  tracepoint program loaded, verified and attached, as ``tokentrace run`` does);
- ``attach``: ``tokentrace run --pid P`` on an idle process, from the command's start
  to its ``attached`` line (Python's imports, the compile, the probes, the rescans).

Per mode: each checkout's median, and this tree over the other's, the ratio of
medians with a 95% interval over rounds (t over the rounds' log ratios). Also written:
the kernel's symbol count (BCC's name checks walked them, see bpf/common.h) and the
call sites of the user-memory read helpers in bpf/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.real_server import ratio_ci  # noqa: E402

CONCERNS = "cuda,nccl,ibverbs,process,sockets,netwait,tls"

# Run inside the checkout under test: prints the seconds a mode took.
_PROBE = r"""
import ctypes, sys, time
sys.path.insert(0, sys.argv[1])
from tracer.probes import loader
mode, concerns = sys.argv[2], sys.argv[3].split(",")
if mode == "compile":
    from bcc import libbcc
    flags = [f.encode() for f in ("-DTT_RINGBUF_PAGES=8192", "-Wno-visibility",
             "-Wno-macro-redefined", "-DTT_NETWAIT", "-DTT_TLS")]
    arr = (ctypes.c_char_p * len(flags))(*flags)
    text = loader.program_text(concerns).encode()
    t = time.perf_counter()
    mod = libbcc.lib.bpf_module_create_c_from_string(text, 0, arr, len(flags), True, None)
    took = time.perf_counter() - t
    if not mod:
        sys.exit("compile failed")
else:
    t = time.perf_counter()
    b = loader.compile_program(concerns)
    took = time.perf_counter() - t
    b.cleanup()
print(f"{took:.4f}")
"""


def timed_mode(root: Path, mode: str, python: str) -> float:
    """Seconds ``mode`` took in checkout ``root`` (a fresh process)."""
    if mode == "attach":
        idle = subprocess.Popen(["sleep", "600"])
        try:
            t = time.perf_counter()
            agent = subprocess.Popen([python, "-m", "tracer", "run", "--pid", str(idle.pid),
                                      "--quiet"], cwd=root, stderr=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, text=True)
            assert agent.stderr is not None
            for line in agent.stderr:
                if "attached" in line:
                    took = time.perf_counter() - t
                    break
            else:
                raise SystemExit(f"{root}: the agent exited without attaching")
            agent.terminate()
            agent.communicate(timeout=60)
            return took
        finally:
            idle.kill()
            idle.wait()
    out = subprocess.run([python, "-c", _PROBE, str(root), mode, CONCERNS], cwd=root,
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def paired(this: list[float], other: list[float]) -> dict[str, object]:
    """This tree over the other: the two medians, and the round-by-round ratio's
    geometric mean with its 95% interval (``bench/real_server.py``'s ``ratio_ci``)."""
    med_a, med_b = statistics.median(this), statistics.median(other)
    return {"this_median_s": round(med_a, 3), "other_median_s": round(med_b, 3),
            "ratio_of_medians": round(med_a / med_b, 3),
            **ratio_ci([a / b for a, b in zip(this, other)])}


def git_head(root: Path) -> str:
    """The checkout's commit, short, with ``+`` where its tree has changes."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(root), *a], capture_output=True,
                              text=True).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain") else "")


def read_helper_sites(root: Path) -> int:
    """Call sites of bpf_probe_read_user(_str) in a checkout's bpf/ C."""
    n = 0
    for f in (root / "bpf").glob("*.c"):
        n += len(re.findall(r"\bbpf_probe_read_user(?:_str)?\s*\(", f.read_text()))
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", type=Path, required=True,
                    help="the other checkout (e.g. a git worktree of an earlier commit)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--modes", default="compile,program,attach")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/compile_time.json")
    args = ap.parse_args()
    python = sys.executable
    modes = args.modes.split(",")
    roots = {"this": ROOT, "other": args.against.resolve()}
    times: dict[str, dict[str, list[float]]] = {m: {"this": [], "other": []} for m in modes}
    for r in range(args.rounds):
        order = ["this", "other"] if r % 2 == 0 else ["other", "this"]
        for mode in modes:
            for which in order:
                times[mode][which].append(timed_mode(roots[which], mode, python))
        print(f"round {r + 1}: " + ", ".join(
            f"{m} {times[m]['this'][-1]:.2f}/{times[m]['other'][-1]:.2f} s" for m in modes),
            file=sys.stderr)
    with open("/proc/kallsyms") as f:
        ksyms = sum(1 for _ in f)
    result = {
        "host_cpus": os.cpu_count(), "kernel": platform.release(), "kallsyms": ksyms,
        "concerns": CONCERNS, "rounds": args.rounds, "against": str(args.against),
        "commits": {which: git_head(root) for which, root in roots.items()},
        "read_helper_call_sites": read_helper_sites(ROOT),
        "modes": {m: {**paired(times[m]["this"], times[m]["other"]),
                      "this_s": [round(x, 3) for x in times[m]["this"]],
                      "other_s": [round(x, 3) for x in times[m]["other"]]} for m in modes},
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("| mode | this tree (median) | the other | this / other (95% CI) |")
    print("|---|---|---|---|")
    for m in modes:
        x = result["modes"][m]
        print(f"| {m} | {x['this_median_s']} s | {x['other_median_s']} s | "
              f"{x['ratio']} ({'-'.join(map(str, x['ci95'] or []))}) |")


if __name__ == "__main__":
    main()
