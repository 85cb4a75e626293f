"""Closed-loop load for the batching samples with the official ``openai`` client.

N requests over C concurrent clients (one keep-alive connection each): chat and plain
completions, prompts of varied length (many longer than a prefill chunk), max_tokens
from 4 to 24, mostly streamed (most of those with ``include_usage``), some not. Writes
per response id what the client saw: TTFT (request sent to first token chunk), e2e,
output tokens, and the usage the server reported. ``--model``, ``--max-tokens``,
``--words``, ``--stream-share`` and ``--chat-share`` shape the mix for other servers
(HF ``transformers serve``: ``--max-tokens 24:150 --words 5:300 --stream-share 0.75``).

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


@dataclass(frozen=True)
class Mix:
    """The shape of the load: ranges are inclusive."""

    model: str = MODEL
    max_tokens: tuple[int, int] = (4, 24)
    words: tuple[int, int] | None = None  # None: the batching samples' three length bands
    stream_share: float = 0.8
    usage_share: float = 0.75  # of the streamed ones, with stream_options.include_usage
    chat_share: float = 0.5


def make_jobs(n: int, seed: int, mix: Mix = Mix()) -> list[Job]:
    """Varied requests, the same for the same seed and mix."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        if mix.words is None:
            words = rng.choice((rng.randint(2, 20), rng.randint(20, 60), rng.randint(60, 110)))
        else:
            words = rng.randint(*mix.words)
        stream = rng.random() < mix.stream_share
        jobs.append(Job(chat=rng.random() < mix.chat_share, stream=stream,
                        include_usage=stream and rng.random() < mix.usage_share,
                        max_tokens=rng.randint(*mix.max_tokens),
                        prompt=" ".join(rng.choice(WORDS) for _ in range(words))))
    return jobs


def send(client: openai.OpenAI, job: Job, model: str = MODEL) -> tuple[str, Seen]:
    """Send one request; returns its response id and what the client saw."""
    kw: dict[str, Any] = {"model": model, "max_tokens": job.max_tokens, "stream": job.stream}
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


def run(url: str, jobs: list[Job], concurrency: int, model: str = MODEL
        ) -> tuple[dict[str, Seen], list[str]]:
    """Send all jobs over ``concurrency`` clients; results by response id, and errors."""
    local = threading.local()
    results: dict[str, Seen] = {}
    errors: list[str] = []

    def one(job: Job) -> None:
        if not hasattr(local, "client"):
            local.client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="none",
                                         max_retries=0, timeout=120)
        try:
            rid, seen = send(local.client, job, model)
            results[rid] = seen
        except (openai.OpenAIError, RuntimeError) as e:
            errors.append(repr(e))

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, jobs))
    return results, errors


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--max-tokens", type=_range, default=(4, 24), metavar="LO:HI")
    p.add_argument("--words", type=_range, default=None, metavar="LO:HI",
                   help="prompt length in words (default: three bands up to 110)")
    p.add_argument("--stream-share", type=float, default=0.8)
    p.add_argument("--usage-share", type=float, default=0.75,
                   help="of the streamed requests, those asking for usage")
    p.add_argument("--chat-share", type=float, default=0.5)
    args = p.parse_args(argv)
    mix = Mix(args.model, args.max_tokens, args.words, args.stream_share, args.usage_share,
              args.chat_share)
    t0 = time.monotonic()
    results, errors = run(args.url, make_jobs(args.requests, args.seed, mix), args.concurrency,
                          args.model)
    elapsed = time.monotonic() - t0
    with open(args.out, "w") as f:
        json.dump({"url": args.url, "concurrency": args.concurrency, "seed": args.seed,
                   "seconds": elapsed, "errors": errors,
                   "requests": {rid: asdict(s) for rid, s in results.items()}}, f, indent=1)
    print(json.dumps({"requests": len(results), "errors": len(errors),
                      "seconds": round(elapsed, 3)}))


if __name__ == "__main__":
    main()
