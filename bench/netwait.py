"""Cost of socket-level request timing (bpf/netwait.c) on a busy server: the stdlib
sample server (thread per connection, TCP_NODELAY off) under closed-loop load from
raw-socket keep-alive clients, in alternating phases of one run: untraced, traced
with `--net-timing syscall` (the socket syscalls only) and traced with socket timing
(the tcp_probe / inet_sock_set_state / tcp_rcv_space_adjust programs on top).

Per phase: requests/s, the tracer's CPU, and (traced) the NETWAIT records it got.
Writes bench/results/netwait.json and prints a table. Needs root.

    .venv/bin/python bench/netwait.py [--rounds 3] [--seconds 8] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from samples.launch import SampleServer  # noqa: E402

LOADGEN = r"""
import json, socket, sys, threading, time
port, conc, secs = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
body = json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]})
def req(stream):
    b = body.replace('"max_tokens"', '"stream": %s, "max_tokens"' % ("true" if stream else "false"))
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
            % len(b)) + b.encode()
reqs = [req(False), req(True)]
done = [0] * conc
stop = time.monotonic() + secs
def worker(i):
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    k = 0
    while time.monotonic() < stop:
        s.sendall(reqs[k % 2]); buf = b""
        while True:
            buf += s.recv(65536)
            head, sep, rest = buf.partition(b"\r\n\r\n")
            if sep and ((b"Content-Length" in head and len(rest) >= int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]))
                        or rest.endswith(b"0\r\n\r\n")):
                break
        done[i] += 1; k += 1
    s.close()
t0 = time.monotonic()
ts = [threading.Thread(target=worker, args=(i,)) for i in range(conc)]
[t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps({"requests": sum(done), "seconds": time.monotonic() - t0}))
"""


def cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def load(port: int, args: argparse.Namespace, seconds: float | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", LOADGEN, str(port), str(args.concurrency),
                          str(seconds or args.seconds)], capture_output=True, text=True,
                         check=True).stdout
    res = json.loads(out)
    res["rps"] = res["requests"] / res["seconds"]
    return res


def traced_phase(server: SampleServer, args: argparse.Namespace, mode: str, tmp: Path) -> dict:
    summary, spans = tmp / f"summary-{mode}.json", tmp / f"spans-{mode}.jsonl"
    tracer = subprocess.Popen([sys.executable, "-m", "tracer", "run", "--pid", str(server.pid),
                               "--jsonl", str(spans), "--quiet", "--net-timing", mode,
                               "--summary", str(summary)],
                              stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert tracer.stderr is not None
    line = tracer.stderr.readline()
    if "attached" not in line:
        raise SystemExit(f"tracer did not attach: {line}{tracer.stderr.read()}")
    cpu0 = cpu_seconds(tracer.pid)
    res = load(server.port, args)
    res["tracer_cpu_s"] = cpu_seconds(tracer.pid) - cpu0
    time.sleep(0.5)
    tracer.send_signal(signal.SIGINT)
    _, err = tracer.communicate(timeout=120)
    res["tracer_report"] = err.strip().splitlines()[-1]
    rep = json.loads(summary.read_text())["report"]
    res["netwait_records"] = {k: v for k, v in rep.items() if k.startswith("netwait_")}
    res["net_timing"] = {k: v for k, v in rep.items() if k.startswith("net_timing.")}
    res["lost"] = {k: v for k, v in rep.items() if k.startswith("capture.lost") and v}
    res["spans"] = sum(1 for _ in spans.open())
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "netwait.json"))
    args = p.parse_args()
    phases: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, \
            SampleServer("samples.stdlib_server", port=18932) as server:
        load(server.port, args, seconds=2)  # warm up
        for r in range(args.rounds):
            for mode in ("untraced", "syscall", "auto"):
                ph = (load(server.port, args) if mode == "untraced"
                      else traced_phase(server, args, mode, Path(tmp)))
                ph.update(mode=mode, round=r)
                phases.append(ph)
                print(json.dumps({k: v for k, v in ph.items() if k != "tracer_report"}),
                      flush=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(ph[key] for ph in phases if ph["mode"] == mode)

    sock = [ph for ph in phases if ph["mode"] == "auto"]
    records = sum(sum(ph["netwait_records"].values()) for ph in sock)
    seconds = sum(ph["seconds"] for ph in sock)
    result = {
        "benchmark": "stdlib sample server (thread per connection, Nagle on), raw-socket "
                     "keep-alive clients, alternate streamed/plain chat, closed loop",
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
        "concurrency": args.concurrency, "seconds_per_phase": args.seconds,
        "rps_median": {m: med(m, "rps") for m in ("untraced", "syscall", "auto")},
        "socket_over_syscall_rps": med("auto", "rps") / med("syscall", "rps"),
        "socket_over_untraced_rps": med("auto", "rps") / med("untraced", "rps"),
        "tracer_cpu_share_of_one_core": {m: med(m, "tracer_cpu_s") / args.seconds
                                         for m in ("syscall", "auto")},
        "tracer_cpu_ms_per_request": {
            m: 1e3 * sum(ph["tracer_cpu_s"] for ph in phases if ph["mode"] == m)
            / sum(ph["requests"] for ph in phases if ph["mode"] == m)
            for m in ("syscall", "auto")},
        "netwait_records_per_s": records / seconds,
        "netwait_records_per_request": records / sum(ph["requests"] for ph in sock),
        "spans_equal_requests": all(ph["spans"] == ph["requests"] for ph in phases
                                    if ph["mode"] != "untraced"),
        "lost": [ph["lost"] for ph in phases if ph.get("lost")],
        "phases": phases,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for k in ("rps_median", "socket_over_syscall_rps", "socket_over_untraced_rps",
              "tracer_cpu_share_of_one_core", "tracer_cpu_ms_per_request",
              "netwait_records_per_s", "netwait_records_per_request", "spans_equal_requests"):
        print(f"{k}: {result[k]}")


if __name__ == "__main__":
    main()
