"""Socket timing for a client on another host: over a veth pair into a network
namespace, not loopback.

The client runs in a network namespace of its own (``ip netns``), reaching the server
through a veth pair, so its segments cross a real device with its own queue and
softirq, as a remote client's do. The server (stdlib ``http.server``, Nagle on) runs
in the host's namespace under ``tokentrace run``. The client is the tests' raw-socket
client timed by its socket's kernel stamps (``tests/kstamps.py``). Reported: the
tracer's TTFT and duration against the client's, the socket waits and send holds the
spans name, and whether every span was timed at the socket.

    sudo .venv/bin/python bench/netwait_veth.py [--requests 200] [--out FILE]

A remote client's TTFT also holds the request's and the token's time on the wire (one
way each); over a veth pair that is microseconds, so the difference measured here is
what the tracer gets wrong, not the network.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from samples.launch import SampleServer  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.live import traced_cli  # noqa: E402

NS = f"ttveth{os.getpid()}"
HOST_IF, NS_IF = f"tth{os.getpid() % 10000}", f"ttn{os.getpid() % 10000}"
HOST_IP, NS_IP = "10.213.0.1", "10.213.0.2"

CLIENT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from tests.test_live_netwait import RawClient
import tests.test_live_netwait as t
import socket
host, port, n = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
class Remote(RawClient):
    def __init__(self):
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.ssock = t.StampedSocket(self.sock)
        self.model, self.first_text, self.id_re = "stdlib-gpt", t.FIRST_TEXT, t.ID
        self.cur = None
c = Remote()
out = [c.chat(stream=i % 2 == 1, max_tokens=3) for i in range(n)]
c.close()
print(json.dumps(out))
"""


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def setup() -> None:
    sh("ip", "netns", "add", NS)
    sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
    sh("ip", "link", "set", NS_IF, "netns", NS)
    sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", HOST_IF)
    sh("ip", "link", "set", HOST_IF, "up")
    sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/24", "dev", NS_IF)
    sh("ip", "netns", "exec", NS, "ip", "link", "set", NS_IF, "up")
    sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")


def teardown() -> None:
    subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True)
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def stat(x: list[float]) -> dict[str, float]:
    x = sorted(x)
    return {"mean_ms": round(statistics.fmean(x) * 1e3, 3), "p50_ms": round(x[len(x) // 2] * 1e3, 3),
            "max_ms": round(x[-1] * 1e3, 3), "within_2ms": sum(v < 0.002 for v in x), "n": len(x)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "bench/results/netwait-veth.json"))
    args = ap.parse_args()
    work = Path(f"/tmp/{NS}")
    work.mkdir(exist_ok=True)
    setup()
    try:
        port = free_port()
        with SampleServer("samples.stdlib_server", port=port, log=work / "server.log",
                          args=["--host", "0.0.0.0"]) as srv:
            with traced_cli(["--pid", str(srv.pid)], str(work / "spans.jsonl")) as got:
                r = subprocess.run(["ip", "netns", "exec", NS, sys.executable, "-c", CLIENT,
                                    str(ROOT), HOST_IP, str(port), str(args.requests)],
                                   capture_output=True, text=True, timeout=300)
                if r.returncode != 0:
                    raise RuntimeError(r.stderr[-3000:])
                calls = json.loads(r.stdout)
                time.sleep(0.5)
    finally:
        teardown()
    spans = {s["attributes"].get("gen_ai.response.id"): s for s in got.spans}
    ttft, dur, waits, holds, timing = [], [], [], [], {}
    for c in calls:
        s = spans[c["id"]]
        a = s["attributes"]
        timing[a["tokentrace.network.timing"]] = timing.get(a["tokentrace.network.timing"], 0) + 1
        ttft.append(abs(a["tokentrace.time_to_first_token"] - c["ttft"]))
        dur.append(abs((s["end_time_unix_nano"] - s["start_time_unix_nano"]) / 1e9 - c["duration"]))
        waits.append(a.get("tokentrace.network.socket_wait", 0.0))
        holds.append(a.get("tokentrace.network.send_hold", 0.0))
    peer = {s["attributes"].get("client.address") for s in got.spans}
    out = {"requests": len(calls), "spans": len(spans), "timing": timing,
           "client_addresses": sorted(p for p in peer if p),
           "ttft_vs_client": stat(ttft), "duration_vs_client": stat(dur),
           "send_hold_over_20ms": sum(h > 0.020 for h in holds),
           "socket_wait_max_ms": round(max(waits) * 1e3, 3),
           "client_own_wait_max_ms": round(max(c["client_wait"] for c in calls) * 1e3, 3),
           "tracer_exit": got.returncode, "lost": "no events lost" not in got.stderr}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0 if out["timing"].get("socket") == len(calls) and not out["lost"] else 1


if __name__ == "__main__":
    sys.exit(main())
