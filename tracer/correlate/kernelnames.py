"""Kernel names a person can read: demangled, then cut to the kernel and its first
type argument (``vectorized_elementwise_kernel<FillFunctor>`` rather than two lines of
template arguments). The full mangled name stays in ``--summary``; this is for the
console, spans and reports. Demangling uses ``cxxfilt`` (libstdc++'s own demangler);
without it, or for a name that is not a C++ symbol, the name is kept as it is.
"""

from __future__ import annotations

from functools import lru_cache

from tracer.probes.cxxnames import demangle, split_top, without_params

MAX_LEN = 80


def _short(text: str) -> str:
    """``ns::a::Name<x, y>`` -> ``Name``; a lambda is named by the function it is in
    (``ns::f<...>(args)::{lambda(int)#1}`` -> ``f``)."""
    parts = split_top(text, "::")
    while len(parts) > 1 and parts[-1].startswith("{"):
        parts.pop()
    last = without_params(parts[-1] if parts else text)
    i = last.find("<")
    return last[:i] if i > 0 else last


def _is_value(arg: str) -> bool:
    a = arg.strip().lstrip("-").rstrip("uUlL")
    return a.isdigit() or arg in ("true", "false") or arg.startswith("(")


def _mangled_base(name: str) -> str | None:
    """The kernel's own identifier from the start of a mangled name the demangler
    refused (names read from a process can be cut short): ``_ZN2at6native13reduce_
    kernelI...`` -> ``reduce_kernel``; None if it does not start like one."""
    if not name.startswith("_Z"):
        return None
    i = 2 + (name[2:3] == "N")
    last = None
    while i < len(name) and name[i].isdigit():
        j = i
        while j < len(name) and name[j].isdigit():
            j += 1
        n = int(name[i:j])
        if j + n > len(name):
            break
        last = name[j:j + n]
        i = j + n
    return last


@lru_cache(maxsize=4096)
def readable(name: str) -> str:
    """A short readable form of a kernel name (mangled or not)."""
    full = demangle(name)
    if full == name:
        return _mangled_base(name) or name[:MAX_LEN]
    return shorten(full)


def shorten(full: str) -> str:
    """The short form of a demangled name (as profilers print them)."""
    words = split_top(without_params(full), " ")
    qualified = words[-1] if words else full  # the return type goes
    last = (split_top(qualified, "::") or [qualified])[-1]
    base = _short(last)
    args = ""
    lt = last.find("<")
    if lt > 0 and last.endswith(">"):
        for arg in split_top(last[lt + 1:-1], ","):
            if not _is_value(arg):
                args = _short(arg)
                break
    return (f"{base}<{args}>" if args else base)[:MAX_LEN]
