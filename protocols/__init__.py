"""Sans-I/O protocol parsers: bytes (with timestamps) in, typed messages out."""
