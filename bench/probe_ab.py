"""Two builds of the probes on one real server, their BPF time paired slice by slice.

    python bench/probe_ab.py --b-root /path/to/other/checkout [--servers hf-cb]
        [--b-env TOKENTRACE_TASK_STORAGE=0] [--rounds 12] [--slice-s 3]
        [--out bench/results/probe_ab.json]

A census of one build (``bench/real_server.py --breakdown-modes census``) against a
census of another taken in another run compares two runs of a server whose speed
drifts by 10-30% on a shared VM: a ~10% change in one program cannot be told from the
host. Here one server runs under one continuous load, and two agents trace it in turn:
A (this checkout, or ``--a-root``) and B (``--b-root``, and/or ``--b-env``), both
attached and kept running, one paused while the other traces (``tokentrace ctl``),
in ABBA order each round, with the kernel's per-program statistics on
(``probe-stats``: two clock reads a run more, the same for both). Per slice, each BPF
program's runs and run time; per program and build, ns a run and runs a token; B over
A paired by round (each round's two A slices against its two B slices), with a 95%
interval over rounds. The server's CPU plan is ``bench/real_server.py``'s.

Two agents of the same build differ too: where the kernel put each one's maps and
JITed programs changes a program's cold-cache time by several percent (``--b-root``
the same as A's, ``--b-env`` a variable neither reads: an A/A run shows it). So the
rounds are spread over ``--sessions`` pairs of freshly started agents, and the
interval is over rounds of all of them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.real_server import Agent, Client, Server, mean_half_width, plan_cpus  # noqa: E402
from tracer.probes.bpfstats import ProgramCost, parse_costs  # noqa: E402


def env_pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep:
            raise SystemExit(f"--a-env/--b-env take NAME=VALUE, not {item!r}")
        out[k] = v
    return out


def take_slice(agent: Agent, client: Client, settle_s: float, slice_s: float
               ) -> dict[str, Any]:
    """Resume ``agent``, let it settle, and count its programs' runs and run time and
    the server's tokens over ``slice_s``; pause it again."""
    agent.ctl("resume")
    time.sleep(settle_s)
    p0 = parse_costs(agent.ctl("probe-stats"))
    t0 = time.monotonic()
    time.sleep(slice_s)
    t1 = time.monotonic()
    p1 = parse_costs(agent.ctl("probe-stats"))
    agent.ctl("pause")
    none = ProgramCost(0, 0)
    programs = {name: [c.runs - p0.get(name, none).runs, c.run_ns - p0.get(name, none).run_ns]
                for name, c in p1.items()}
    return {"t0": t0, "wall_s": t1 - t0, "tokens": client.slice(t0, t1)["tokens"],
            "programs": {k: v for k, v in programs.items() if v[0]}}


def mean_ci(xs: list[float]) -> dict[str, Any]:
    """Mean of ``xs``, its 95% interval (None below two) and how many."""
    m, half = mean_half_width(xs)
    ci = None if half is None else [round(m - half, 4), round(m + half, 4)]
    return {"mean": round(m, 4), "ci95": ci, "n": len(xs)}


def bpf_us_per_token(slices: list[dict[str, Any]]) -> float:
    ns = sum(v[1] for s in slices for v in s["programs"].values())
    tokens = sum(s["tokens"] for s in slices)
    return ns / 1000 / tokens if tokens else float("nan")


def summarise(rounds: list[dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per program and build: runs a token and ns a run over all slices; B over A, by
    round: each round's ns a run (and BPF us a token) of B's slices over A's."""
    out: dict[str, Any] = {"programs": {}}
    names = {n for r in rounds for b in "AB" for s in r[b] for n in s["programs"]}
    for name in sorted(names):
        row: dict[str, Any] = {}
        for b in "AB":
            sl = [s for r in rounds for s in r[b]]
            runs = sum(s["programs"].get(name, [0, 0])[0] for s in sl)
            ns = sum(s["programs"].get(name, [0, 0])[1] for s in sl)
            tokens = sum(s["tokens"] for s in sl)
            row[b] = {"runs_per_token": round(runs / tokens, 3) if tokens else None,
                      "ns_per_run": round(ns / runs, 1) if runs else None}
        ratios = []
        for r in rounds:
            per = {}
            for b in "AB":
                runs = sum(s["programs"].get(name, [0, 0])[0] for s in r[b])
                ns = sum(s["programs"].get(name, [0, 0])[1] for s in r[b])
                per[b] = ns / runs if runs else None
            if per["A"] and per["B"]:
                ratios.append(per["B"] / per["A"])
        if ratios:
            row["ns_per_run_B_over_A"] = mean_ci(ratios)
        out["programs"][name] = row
    per_round = [bpf_us_per_token(r["B"]) / bpf_us_per_token(r["A"]) for r in rounds]
    out["bpf_us_per_token"] = {b: round(bpf_us_per_token([s for r in rounds for s in r[b]]), 3)
                               for b in "AB"}
    out["bpf_us_per_token_B_over_A"] = mean_ci(per_round)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", default="hf-cb", choices=["hf-cb", "hf-plain", "batching", "grpc"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--a-root", type=Path, default=ROOT, help="build A's checkout (default: this one)")
    ap.add_argument("--b-root", type=Path, default=ROOT, help="build B's checkout (default: this one)")
    ap.add_argument("--a-env", action="append", default=[], metavar="NAME=VALUE",
                    help="more environment for A's agent (repeatable)")
    ap.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE",
                    help="more environment for B's agent (repeatable)")
    ap.add_argument("--agent-args", default="", help="more `tokentrace run` options, both agents")
    ap.add_argument("--rounds", type=int, default=12, help="ABBA rounds (4 slices each)")
    ap.add_argument("--sessions", type=int, default=3,
                    help="fresh pairs of agents the rounds are spread over (default 3)")
    ap.add_argument("--slice-s", type=float, default=3.0)
    ap.add_argument("--settle-s", type=float, default=1.0, help="after each resume")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", default="16:48")
    ap.add_argument("--warmup-s", type=float, default=10.0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "probe_ab.json")
    args = ap.parse_args(argv)
    if args.a_root == args.b_root and args.a_env == args.b_env:
        raise SystemExit("A and B are the same build: give --b-root or --b-env")
    sessions = max(1, min(args.sessions, args.rounds))
    cpus = plan_cpus()
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="probe-ab-") as tmp:
        work = Path(tmp)
        server = Server(args.servers, args.device, work, cpus["server"])
        client = Client(server, args, cpus["client"])
        agents: dict[str, Agent] = {}
        reports: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
        rounds: list[dict[str, Any]] = []
        try:
            client.ask("start")
            client.first_tokens()
            time.sleep(args.warmup_s)
            for i in range(args.rounds):
                if i * sessions // args.rounds != len(reports["A"]) or not agents:
                    for b, a in agents.items():  # this session's agents out, new ones in
                        reports[b].append(a.stop())
                    agents = {}
                    for b, root, env in (("A", args.a_root, args.a_env),
                                         ("B", args.b_root, args.b_env)):
                        agents[b] = Agent(server, work, cpus["agent"], args.agent_args.split(),
                                          name=b, root=root.resolve(), env=env_pairs(env))
                        agents[b].ctl("pause")
                        agents[b].ctl("probe-stats on")
                order = "ABBA" if i % 2 == 0 else "BAAB"
                r: dict[str, Any] = {"A": [], "B": [], "session": len(reports["A"])}
                for b in order:
                    r[b].append(take_slice(agents[b], client, args.settle_s, args.slice_s))
                rounds.append(r)
                s = summarise(rounds)
                print(f"round {i + 1}: BPF us a token A {s['bpf_us_per_token']['A']}, "
                      f"B {s['bpf_us_per_token']['B']}; B/A {s['bpf_us_per_token_B_over_A']}",
                      file=sys.stderr, flush=True)
        finally:
            for b, a in agents.items():
                reports[b].append(a.stop())
            load = client.ask("stop") if client.proc.poll() is None else {}
            client.close()
            server.stop()
    result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "seconds": round(time.monotonic() - t_start, 1), "load": load,
              "sessions": sessions,
              "lost": {b: [{k: v for k, v in (rep.get("report") or {}).items()
                            if k.startswith("capture.lost")} for rep in reps]
                       for b, reps in reports.items()},
              **summarise(rounds), "rounds": rounds}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("bpf_us_per_token", "bpf_us_per_token_B_over_A")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
