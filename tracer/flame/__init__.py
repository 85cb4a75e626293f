"""Flame graphs of the code paths that launched a request's (or a service's) GPU work.

``tokentrace flame`` reads the launch-site stacks that spans carry (``--jsonl`` of a run
with ``--stacks``) or replays a capture, and writes folded stacks, a pprof profile and
an interactive HTML page (``model`` -> ``folded``/``pprof``/``html``; ``load`` reads
the inputs). docs/flame.md.
"""
