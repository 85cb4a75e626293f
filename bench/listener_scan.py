"""What the agent's once-a-second look for listening ports costs (the netwait port
filter, ``--port``), against the number of TCP sockets in the namespace.

    python bench/listener_scan.py [--sockets 4000] [--calls 20] [--out FILE]

Makes ``--sockets`` short loopback connections whose client closes first (each leaves
a TIME_WAIT row in /proc/net/tcp, as a server's clients do on a busy node), then times
per call: the whole table parsed (``procfs.inet_sockets``, what the agent read every
second for every traced process before), the listening rows only (the same read, the
state looked at before the addresses are parsed: the agent's way for a process in
another network namespace) and sock_diag asked for listening sockets
(``sockdiag.tcp_listening``: the agent's way in its own namespace, once a round for all
the processes in it). Writes bench/results/listener_scan.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracer.probes import procfs, sockdiag  # noqa: E402


def time_wait_rows() -> int:
    rows = 0
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/self/net/{name}").read_text().splitlines()[1:]:
            rows += line.split()[3] == "06"
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sockets", type=int, default=4000)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "listener_scan.json"))
    args = ap.parse_args(argv)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(512)

    def accept() -> None:
        while True:
            conn, _ = srv.accept()
            conn.recv(1)  # until the client's FIN: it closed first
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    for _ in range(args.sockets):
        c = socket.create_connection(srv.getsockname())
        c.close()
    time.sleep(0.5)
    pid = os.getpid()
    ways = {"whole_table": lambda: procfs.inet_sockets(pid),
            "listening_rows": lambda: procfs.inet_sockets(pid, listening=True),
            "sock_diag": sockdiag.tcp_listening}
    ms = {}
    for name, call in ways.items():
        t0 = time.perf_counter()
        for _ in range(args.calls):
            call()
        ms[name] = round((time.perf_counter() - t0) / args.calls * 1000, 3)
    doc = {"command": "python " + " ".join(["bench/listener_scan.py", *(argv or sys.argv[1:])]),
           "cpus": os.cpu_count(), "time_wait_rows": time_wait_rows(), "ms_per_call": ms}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
