"""The official openai client's async flavour (httpx on asyncio: TLS through memory
BIOs, the client writing first) over HTTPS, run as its own process by
tests/test_live_tls.py so the tracer can follow the client's end.

    python tests/tls_async_client.py BASE_URL CAFILE REQUESTS

Waits for a line on stdin (the tracer attaches meanwhile), sends REQUESTS chat
requests on one keep-alive connection (streamed and not in turn), prints one JSON line
per request and ``done``.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys

import httpx
import openai


async def run(base_url: str, cafile: str, n: int) -> None:
    http = httpx.AsyncClient(verify=ssl.create_default_context(cafile=cafile))
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="sk-async-client",
                                http_client=http, max_retries=0)
    for i in range(n):
        stream = i % 2 == 1
        kw = {"stream_options": {"include_usage": True}} if stream else {}
        resp = await client.chat.completions.create(
            model="tiny-gpt", messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=3 + i % 3, stream=stream, **kw)
        if stream:
            rid, usage = None, None
            async for ch in resp:
                rid = ch.id
                usage = ch.usage or usage
        else:
            rid, usage = resp.id, resp.usage
        print(json.dumps({"id": rid, "stream": stream,
                          "output_tokens": usage.completion_tokens if usage else None}),
              flush=True)
    await http.aclose()


def main() -> None:
    sys.stdin.readline()
    asyncio.run(run(sys.argv[1], sys.argv[2], int(sys.argv[3])))
    print("done", flush=True)


if __name__ == "__main__":
    main()
