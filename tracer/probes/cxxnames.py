"""C++ symbol names as text: demangled (``cxxfilt``, libstdc++'s own demangler) and cut
at the top level of their template and parameter brackets. Shared by native stack
frames (``probes/stacks.py``) and kernel names (``correlate/kernelnames.py``)."""

from __future__ import annotations

try:
    import cxxfilt
except ImportError:  # pragma: no cover - a dependency; kept optional at run time
    cxxfilt = None


def demangle(name: str) -> str:
    """The demangled name, or ``name`` if it is not a mangled C++ symbol."""
    if cxxfilt is None or not name.startswith("_Z"):
        return name
    try:
        return cxxfilt.demangle(name)
    except (cxxfilt.InvalidName, ValueError, UnicodeError):
        return name


def split_top(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` where no <...>, (...) or {...} is open."""
    out, depth, i, start = [], 0, 0, 0
    while i < len(text):
        ch = text[i]
        if ch in "<({":
            depth += 1
        elif ch in ">)}":
            depth -= 1
        elif depth == 0 and text.startswith(sep, i):
            out.append(text[start:i].strip())
            i += len(sep)
            start = i
            continue
        i += 1
    out.append(text[start:].strip())
    return [x for x in out if x]


def without_params(text: str) -> str:
    """``ret ns::f<a>(int, x)`` -> ``ret ns::f<a>``: cut at the first '(' outside <>."""
    depth = 0
    for i, ch in enumerate(text):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0:
            return text[:i]
    return text


def native_name(symbol: str) -> str:
    """A readable frame name: demangled, parameters and return type dropped, template
    arguments folded (``at::native::gpu_kernel_impl<...>``)."""
    full = demangle(symbol)
    if full == symbol:
        return symbol
    text = without_params(full)
    words = split_top(text, " ")
    text = words[-1] if words else text
    out, depth = [], 0
    for ch in text:
        if ch == "<":
            if depth == 0:
                out.append("<...>")
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    return "".join(out)[:160]
