"""Load and attach BPF programs, choose traced processes, read ring buffers into events."""
