"""Continuous-batching inference servers that write their own ground truth.

One OpenAI API (FastAPI on uvicorn) over one continuous-batching engine
(``engine.py``: FIFO queue, max batch, chunked prefill, one batched tiny-GPT forward per
step), in three layouts (``server.py``): an engine thread in the API process, an engine
process behind a unix socket, and two tensor-parallel rank processes. Every engine step
and every finished request is written as a JSON line to a truth file (``truth.py``),
so a tracer's per-request GPU attribution can be scored. See docs/samples.md.
"""
