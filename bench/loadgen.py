"""Closed-loop HTTP load: N keep-alive connections sending OpenAI chat requests for a
fixed time. Prints one JSON line: completed requests, errors, requests/s.

    python bench/loadgen.py --port 8000 --concurrency 8 --seconds 10 [--stream]
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--stream", action="store_true")
    args = p.parse_args()
    body = json.dumps({"model": "tiny-gpt", "max_tokens": args.max_tokens, "stream": args.stream,
                       "messages": [{"role": "user", "content": "benchmark prompt " * 20}]})
    done = [0] * args.concurrency
    errors = [0] * args.concurrency
    stop = time.monotonic() + args.seconds

    def worker(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=30)
        while time.monotonic() < stop:
            try:
                conn.request("POST", "/v1/chat/completions", body,
                             {"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
                if r.status == 200:
                    done[i] += 1
                else:
                    errors[i] += 1
            except OSError:
                errors[i] += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=30)

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    print(json.dumps({"requests": sum(done), "errors": sum(errors), "seconds": elapsed,
                      "rps": sum(done) / elapsed}))


if __name__ == "__main__":
    main()
