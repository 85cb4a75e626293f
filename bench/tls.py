"""Cost of reading requests inside TLS (bpf/tls.c): HTTPS servers under closed-loop load
from keep-alive TLS clients, in alternating phases of one run: untraced, traced with
`--tls off` (the socket probes only: ciphertext captured and counted as TLS the tracer
cannot read) and traced with the TLS probes (SSL_read/SSL_write/SSL_do_handshake, BIO
reads and writes, per-process uprobe_multi links).

Two servers, the two ways a Python server does TLS:
- ``stdlib``: http.server on ssl.SSLSocket, a thread per connection (OpenSSL on the
  socket: SSL_set_fd; a fast server, so the probes' share of a request is large);
- ``openai``: the sample OpenAI server (uvicorn on uvloop: ssl.SSLObject on memory
  BIOs), a tiny GPT on the CPU, 4 tokens per request, streamed and not.

And the probes' cost per call, apart from any server (``echo``): a process echoing
64-byte messages to itself over a TLS connection on loopback (ssl.SSLSocket both ends:
per round trip 4 SSL calls, 2 SSL_write records through BIO_write), its CPU per round
trip in the same three modes.

Per phase: requests/s, the server's CPU per request (the probes' traps and BPF run in
the traced process: this is what the TLS probes cost the service), the tracer's CPU
and, traced with TLS, the SSL calls seen and whether every request became a span. On a
2-vCPU VM the tracer's own CPU competes with the server, so requests/s fall by more
than the probes cost; `--tls off` reads nothing (ciphertext is only counted), so the
tracer does less work there than with the plaintext to parse and export. Writes
bench/results/tls.json (or --out) and prints a table. Needs root.

    .venv/bin/python bench/tls.py [--rounds 3] [--seconds 6] [--concurrency 8]
        [--servers stdlib,openai]
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
from samples.tlscert import make_cert  # noqa: E402

LOADGEN = r"""
import json, socket, ssl, sys, threading, time
port, conc, secs, cafile = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
ctx = ssl.create_default_context(cafile=cafile)
body = json.dumps({"model": "tiny-gpt", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]})
def req(stream):
    b = body.replace('"max_tokens"', '"stream": %s, "max_tokens"' % ("true" if stream else "false"))
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-bench\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(b)) + b.encode()
reqs = [req(False), req(True)]
done = [0] * conc
stop = time.monotonic() + secs
def worker(i):
    raw = socket.create_connection(("127.0.0.1", port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s = ctx.wrap_socket(raw, server_hostname="localhost")
    k = 0
    while time.monotonic() < stop:
        s.sendall(reqs[k % 2]); buf = b""
        while True:
            buf += s.recv(65536)
            head, sep, rest = buf.partition(b"\r\n\r\n")
            low = head.lower()
            if sep and ((b"content-length" in low and len(rest) >= int(low.split(b"content-length: ")[1].split(b"\r\n")[0]))
                        or rest.endswith(b"0\r\n\r\n")):
                break
        done[i] += 1; k += 1
    s.close()
t0 = time.monotonic()
ts = [threading.Thread(target=worker, args=(i,)) for i in range(conc)]
[t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps({"requests": sum(done), "seconds": time.monotonic() - t0}))
"""

MODES = ("untraced", "tls_off", "tls")

ECHO = r"""
import resource, socket, ssl, sys, threading
cert, key, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); sctx.load_cert_chain(cert, key)
def serve():
    s = sctx.wrap_socket(srv.accept()[0], server_side=True)
    while (d := s.recv(1024)):
        s.sendall(d)
threading.Thread(target=serve, daemon=True).start()
cl = ssl.create_default_context(cafile=cert).wrap_socket(
    socket.create_connection(srv.getsockname()), server_hostname="localhost")
print("ready", flush=True)
while sys.stdin.readline().strip() == "go":
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(n):
        cl.sendall(b"x" * 64); cl.recv(1024)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
    print(cpu / n * 1e6, flush=True)
"""


def bench_echo(cert: tuple[Path, Path], args: argparse.Namespace, tmp: Path) -> dict:
    """CPU per TLS round trip of the echo process, untraced / --tls off / TLS probes."""
    echo = subprocess.Popen([sys.executable, "-c", ECHO, str(cert[0]), str(cert[1]),
                             str(args.echo_round_trips)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert echo.stdin is not None and echo.stdout is not None
    assert echo.stdout.readline().strip() == "ready"

    def measure() -> float:
        echo.stdin.write("go\n")
        echo.stdin.flush()
        return float(echo.stdout.readline())

    phases = []
    try:
        measure()  # warm up
        for r in range(args.rounds):
            for mode in MODES:
                tracer = None
                if mode != "untraced":
                    tracer = subprocess.Popen(
                        [sys.executable, "-m", "tracer", "run", "--pid", str(echo.pid),
                         "--quiet", "--tls", "off" if mode == "tls_off" else "auto"],
                        stderr=subprocess.PIPE, text=True, cwd=ROOT)
                    assert tracer.stderr is not None
                    if "attached" not in tracer.stderr.readline():
                        raise SystemExit(f"tracer did not attach: {tracer.stderr.read()}")
                phases.append({"mode": mode, "round": r, "cpu_us_per_round_trip": measure()})
                if tracer is not None:
                    tracer.send_signal(signal.SIGINT)
                    tracer.communicate(timeout=120)
                print(json.dumps({"server": "echo", **phases[-1]}), flush=True)
    finally:
        echo.stdin.close()
        echo.wait(timeout=30)
    med = {m: statistics.median(p["cpu_us_per_round_trip"] for p in phases if p["mode"] == m)
           for m in MODES}
    return {"server": "echo", "round_trips_per_phase": args.echo_round_trips,
            "cpu_us_per_round_trip_median": med,
            "tls_probes_us_per_round_trip": med["tls"] - med["tls_off"],
            # 4 SSL calls (2 SSL_write, 2 SSL_read) and 2 BIO_write records per round trip
            "tls_probes_us_per_ssl_call": (med["tls"] - med["tls_off"]) / 4,
            "phases": phases}


def cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def load(port: int, cafile: Path, args: argparse.Namespace, seconds: float | None = None,
         server_pid: int = 0) -> dict:
    cpu0 = cpu_seconds(server_pid) if server_pid else 0.0
    out = subprocess.run([sys.executable, "-c", LOADGEN, str(port), str(args.concurrency),
                          str(seconds or args.seconds), str(cafile)],
                         capture_output=True, text=True, check=True).stdout
    res = json.loads(out)
    res["rps"] = res["requests"] / res["seconds"]
    if server_pid:
        res["server_cpu_s"] = cpu_seconds(server_pid) - cpu0
    return res


def traced_phase(server: SampleServer, cafile: Path, args: argparse.Namespace, mode: str,
                 tmp: Path) -> dict:
    summary, spans = tmp / f"summary-{mode}.json", tmp / f"spans-{mode}.jsonl"
    tracer = subprocess.Popen([sys.executable, "-m", "tracer", "run", "--pid", str(server.pid),
                               "--jsonl", str(spans), "--quiet", "--summary", str(summary),
                               "--tls", "off" if mode == "tls_off" else "auto"],
                              stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert tracer.stderr is not None
    line = tracer.stderr.readline()
    if "attached" not in line:
        raise SystemExit(f"tracer did not attach: {line}{tracer.stderr.read()}")
    cpu0 = cpu_seconds(tracer.pid)
    res = load(server.port, cafile, args, server_pid=server.pid)
    res["tracer_cpu_s"] = cpu_seconds(tracer.pid) - cpu0
    time.sleep(0.5)
    tracer.send_signal(signal.SIGINT)
    tracer.communicate(timeout=120)
    rep = json.loads(summary.read_text())["report"]
    res["tls"] = {k: v for k, v in rep.items() if "tls" in k and v}
    res["lost"] = {k: v for k, v in rep.items() if k.startswith("capture.lost") and v}
    res["parser_errors"] = rep.get("parser_errors", 0)
    res["spans"] = sum(1 for _ in spans.open())
    return res


def bench_server(name: str, cert: tuple[Path, Path], args: argparse.Namespace,
                 tmp: Path) -> dict:
    if name == "stdlib":
        server = SampleServer("samples.stdlib_server", port=18943, tls=cert, health="/")
    else:
        server = SampleServer(port=18944, tls=cert, args=["--loop", "uvloop"])
    phases: list[dict] = []
    with server:
        load(server.port, cert[0], args, seconds=2)  # warm up
        for r in range(args.rounds):
            for mode in MODES:
                ph = (load(server.port, cert[0], args, server_pid=server.pid)
                      if mode == "untraced"
                      else traced_phase(server, cert[0], args, mode, tmp))
                ph.update(mode=mode, round=r)
                phases.append(ph)
                print(json.dumps({"server": name, **ph}), flush=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(ph[key] for ph in phases if ph["mode"] == mode)

    def per_request(mode: str, key: str) -> float:
        return (sum(ph[key] for ph in phases if ph["mode"] == mode)
                / sum(ph["requests"] for ph in phases if ph["mode"] == mode))

    tls = [ph for ph in phases if ph["mode"] == "tls"]
    # per round, the TLS phase against the phases just before it: drift-free ratios
    rounds = [{m: ph["rps"] for ph in phases if ph["round"] == r for m in [ph["mode"]]}
              for r in range(args.rounds)]
    return {
        "server": name,
        "rps_median": {m: med(m, "rps") for m in MODES},
        "tls_over_tls_off_rps": med("tls", "rps") / med("tls_off", "rps"),
        "tls_over_untraced_rps": med("tls", "rps") / med("untraced", "rps"),
        "per_round_tls_over_tls_off": [x["tls"] / x["tls_off"] for x in rounds],
        "per_round_tls_over_untraced": [x["tls"] / x["untraced"] for x in rounds],
        "server_cpu_ms_per_request": {m: 1e3 * per_request(m, "server_cpu_s") for m in MODES},
        "server_cpu_tls_over_tls_off": per_request("tls", "server_cpu_s")
        / per_request("tls_off", "server_cpu_s"),
        "server_cpu_tls_over_untraced": per_request("tls", "server_cpu_s")
        / per_request("untraced", "server_cpu_s"),
        "tracer_cpu_share_of_one_core": {m: med(m, "tracer_cpu_s") / args.seconds
                                         for m in ("tls_off", "tls")},
        "tracer_cpu_ms_per_request": {m: 1e3 * per_request(m, "tracer_cpu_s")
                                      for m in ("tls_off", "tls")},
        "ssl_calls_per_request": (sum(ph["tls"].get("capture.tls.calls", 0) for ph in tls)
                                  / sum(ph["requests"] for ph in tls)),
        "spans_equal_requests_with_tls": all(ph["spans"] == ph["requests"] for ph in tls),
        "spans_with_tls_off": sum(ph["spans"] for ph in phases if ph["mode"] == "tls_off"),
        "parser_errors": sum(ph.get("parser_errors", 0) for ph in phases),
        "lost": [ph["lost"] for ph in phases if ph.get("lost")],
        "phases": phases,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--servers", default="echo,stdlib,openai")
    p.add_argument("--echo-round-trips", type=int, default=20000)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "tls.json"))
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        cert = make_cert(Path(tmp) / "cert")
        for name in args.servers.split(","):
            results.append(bench_echo(cert, args, Path(tmp)) if name == "echo"
                           else bench_server(name, cert, args, Path(tmp)))
    doc = {
        "benchmark": "HTTPS servers, keep-alive TLS clients (Python ssl), alternate streamed/"
                     "plain chat, closed loop; phases untraced / traced --tls off / traced "
                     "with the TLS probes, alternating in one run",
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
        "concurrency": args.concurrency, "seconds_per_phase": args.seconds,
        "rounds": args.rounds, "servers": results,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for r in results:
        print(f"\n{r['server']}:")
        if r["server"] == "echo":
            for k in ("cpu_us_per_round_trip_median", "tls_probes_us_per_round_trip",
                      "tls_probes_us_per_ssl_call"):
                print(f"  {k}: {r[k]}")
            continue
        for k in ("rps_median", "tls_over_tls_off_rps", "tls_over_untraced_rps",
                  "per_round_tls_over_tls_off", "per_round_tls_over_untraced",
                  "server_cpu_ms_per_request", "server_cpu_tls_over_tls_off",
                  "server_cpu_tls_over_untraced",
                  "tracer_cpu_share_of_one_core", "tracer_cpu_ms_per_request",
                  "ssl_calls_per_request", "spans_equal_requests_with_tls",
                  "spans_with_tls_off", "parser_errors", "lost"):
            print(f"  {k}: {r[k]}")


if __name__ == "__main__":
    main()
