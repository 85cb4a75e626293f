"""BCC C programs, one file per concern. ``source(name)`` returns a file's text."""

from importlib import resources

CONCERNS = ("process", "sockets")


def source(name: str) -> str:
    """Text of ``bpf/<name>.c`` (or ``<name>.h`` when ``name`` ends in .h)."""
    fname = name if name.endswith(".h") else f"{name}.c"
    return resources.files(__name__).joinpath(fname).read_text()
