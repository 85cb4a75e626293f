"""Turn finished requests into spans, tables, files and metrics."""
