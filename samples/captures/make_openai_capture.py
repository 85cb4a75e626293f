"""Record samples/captures/openai-http1.ttcap: the sample OpenAI server traced while
the official openai client makes a fixed set of requests. The client's own view of
each request goes to openai-http1.expected.json, the ground truth the replay tests
compare with. Needs root (BPF); run from the repository root:

    sudo .venv/bin/python -m samples.captures.make_openai_capture
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import http.client
import openai

from samples.launch import SampleServer
from tracer.probes.session import CaptureConfig
from tracer.runner import TraceRun

HERE = Path(__file__).resolve().parent


def main() -> None:
    expected: list[dict] = []
    with SampleServer(port=8799, args=["--token-rate", "400"]) as server:
        run = TraceRun(CaptureConfig(pids=[server.pid]), [], record=str(HERE / "openai-http1.ttcap"))
        run.start()
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-capture",
                               max_retries=0)
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        s = client.chat.completions.create(model="tiny-gpt", messages=msgs, max_tokens=12,
                                           stream=True, stream_options={"include_usage": True})
        chunks = list(s)
        expected.append({"path": "/v1/chat/completions", "stream": True, "status": 200,
                         "output_tokens": chunks[-1].usage.completion_tokens,
                         "input_tokens": chunks[-1].usage.prompt_tokens})
        r = client.chat.completions.create(model="tiny-gpt", messages=msgs, max_tokens=7)
        expected.append({"path": "/v1/chat/completions", "stream": False, "status": 200,
                         "output_tokens": r.usage.completion_tokens,
                         "input_tokens": r.usage.prompt_tokens})
        n = sum(1 for c in client.completions.create(model="tiny-gpt", prompt="Once upon a time",
                                                     max_tokens=9, stream=True)
                if c.choices and c.choices[0].text)
        expected.append({"path": "/v1/completions", "stream": True, "status": 200,
                         "output_tokens": n, "input_tokens": None})
        r2 = client.completions.create(model="tiny-gpt", prompt="Hello", max_tokens=5)
        expected.append({"path": "/v1/completions", "stream": False, "status": 200,
                         "output_tokens": r2.usage.completion_tokens,
                         "input_tokens": r2.usage.prompt_tokens})
        try:
            client.chat.completions.create(model="gpt-9", messages=msgs)
        except openai.NotFoundError:
            expected.append({"path": "/v1/chat/completions", "stream": False, "status": 404,
                             "output_tokens": None, "input_tokens": None})
        h = http.client.HTTPConnection("127.0.0.1", server.port)  # keep-alive: one connection
        for path in ("/v1/models", "/health"):
            h.request("GET", path)
            resp = h.getresponse()
            resp.read()
            expected.append({"path": path, "stream": False, "status": resp.status,
                             "output_tokens": None, "input_tokens": None})
        h.close()
        time.sleep(0.3)
        run.stop()
    (HERE / "openai-http1.expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(f"{len(expected)} requests recorded")


if __name__ == "__main__":
    main()
