"""Closed-loop load for the batching samples with the official ``openai`` client.

N requests over C concurrent clients (one keep-alive connection each): chat and plain
completions, prompts of varied length (many longer than a prefill chunk), max_tokens
from 4 to 24, mostly streamed (most of those with ``include_usage``), some not. Writes
per response id what the client saw: TTFT (request sent to first token chunk), e2e,
output tokens, and the usage the server reported.

    python -m samples.batching.load --url http://127.0.0.1:8000 --requests 64 \\
        --concurrency 8 --out load.json [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import openai

MODEL = "tiny-gpt"
WORDS = ("the model reads a prompt then writes tokens one step at a time while other "
         "requests share the batch and the scheduler admits new ones as slots free up, "
         "so prefill and decode mix in every step of the engine").split()


@dataclass
class Job:
    """One request to send."""

    chat: bool
    stream: bool
    include_usage: bool
    max_tokens: int
    prompt: str


@dataclass
class Seen:
    """What the client saw of one response."""

    endpoint: str
    streamed: bool
    include_usage: bool
    max_tokens: int
    sent_ns: int
    ttft_ns: int | None
    e2e_ns: int
    tokens: int
    usage: dict[str, int] | None


def make_jobs(n: int, seed: int) -> list[Job]:
    """Varied requests, the same for the same seed."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        words = rng.choice((rng.randint(2, 20), rng.randint(20, 60), rng.randint(60, 110)))
        stream = rng.random() < 0.8
        jobs.append(Job(chat=rng.random() < 0.5, stream=stream,
                        include_usage=stream and rng.random() < 0.75,
                        max_tokens=rng.randint(4, 24),
                        prompt=" ".join(rng.choice(WORDS) for _ in range(words))))
    return jobs


def send(client: openai.OpenAI, job: Job) -> tuple[str, Seen]:
    """Send one request; returns its response id and what the client saw."""
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": job.max_tokens, "stream": job.stream}
    if job.include_usage:
        kw["stream_options"] = {"include_usage": True}
    endpoint = "chat" if job.chat else "completions"
    t0 = time.monotonic_ns()
    if job.chat:
        resp = client.chat.completions.create(
            messages=[{"role": "user", "content": job.prompt}], **kw)
    else:
        resp = client.completions.create(prompt=job.prompt, **kw)
    if not job.stream:
        u = resp.usage
        return resp.id, Seen(endpoint, False, False, job.max_tokens, t0, None,
                             time.monotonic_ns() - t0, u.completion_tokens if u else 0,
                             u.model_dump() if u else None)
    rid, ttft, tokens, usage = None, None, 0, None
    for chunk in resp:
        rid = rid or chunk.id
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for c in chunk.choices:
            text = c.delta.content if job.chat else c.text
            if text:
                tokens += 1
                if ttft is None:
                    ttft = time.monotonic_ns() - t0
    if rid is None:
        raise RuntimeError("stream without any chunk")
    return rid, Seen(endpoint, True, job.include_usage, job.max_tokens, t0, ttft,
                     time.monotonic_ns() - t0, tokens, usage)


def run(url: str, jobs: list[Job], concurrency: int) -> tuple[dict[str, Seen], list[str]]:
    """Send all jobs over ``concurrency`` clients; results by response id, and errors."""
    local = threading.local()
    results: dict[str, Seen] = {}
    errors: list[str] = []

    def one(job: Job) -> None:
        if not hasattr(local, "client"):
            local.client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="none",
                                         max_retries=0, timeout=120)
        try:
            rid, seen = send(local.client, job)
            results[rid] = seen
        except (openai.OpenAIError, RuntimeError) as e:
            errors.append(repr(e))

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, jobs))
    return results, errors


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.monotonic()
    results, errors = run(args.url, make_jobs(args.requests, args.seed), args.concurrency)
    elapsed = time.monotonic() - t0
    with open(args.out, "w") as f:
        json.dump({"url": args.url, "concurrency": args.concurrency, "seed": args.seed,
                   "seconds": elapsed, "errors": errors,
                   "requests": {rid: asdict(s) for rid, s in results.items()}}, f, indent=1)
    print(json.dumps({"requests": len(results), "errors": len(errors),
                      "seconds": round(elapsed, 3)}))


if __name__ == "__main__":
    main()
