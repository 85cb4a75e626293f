"""`tokentrace report`: per-request cost reports (CSV, JSON, HTML) from exported spans.

The data flow is one way: ``load`` reads the span JSONL into rows (``rows``),
``summary`` groups them by model and tenant, ``tables`` writes CSV/JSON and ``page``
the HTML with its plots. ``cli`` is the command.
"""
