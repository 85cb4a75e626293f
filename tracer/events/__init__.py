"""The event schema: typed records from capture, the only input to analysis."""
