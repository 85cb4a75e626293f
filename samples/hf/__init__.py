"""Hugging Face ``transformers serve`` as a traced server nobody here wrote: a tiny
Llama built offline, the ground truth recorded inside the server by a harness-only
``sitecustomize`` (never by the product), and the load that drives it."""
