"""tokentrace: zero-code eBPF tracing for LLM inference services."""

__version__ = "0.1.0"
