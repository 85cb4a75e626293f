"""Secrets the tracer sees and must not keep: credential headers, command-line keys,
and files other users could read.

- ``mask_token``/``token_span``: a credential header's key is replaced, in captures,
  by an HMAC of it as long as it (``SecretMasker`` in ``tracer.events.capture``; in
  HTTP/2 header blocks, ``tracer.events.h2mask``).
- ``redact_args``: a command line with whatever looks like a key or token replaced.
- ``open_private``: every file the tracer writes is created (or truncated) mode 0600.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from typing import IO, Any, Iterable

REDACTED = "[REDACTED]"

# an option or variable whose name says it holds a secret, by its words
# (--api-key, --hf-token, HF_TOKEN, AWS_SECRET_ACCESS_KEY; not --tokenizer, --max-tokens)
_SECRET_WORDS = frozenset({"token", "secret", "password", "passwd", "pass", "credential",
                           "credentials", "auth", "authorization", "apikey", "signature",
                           "cookie"})
_KEY_QUALIFIERS = frozenset({"api", "access", "private", "secret", "client", "signing",
                             "master", "admin", "openai", "hf", "service"})


def secret_name(name: str) -> bool:
    """Whether an option or variable name says its value is a secret: its last word
    does (``--hf-token``, ``OPENAI_API_KEY``; not ``--token-rate``, ``--max-tokens``)."""
    words = [w for w in re.split(r"[-_.]+", name.lower()) if w]
    if not words:
        return False
    last = words[-1]
    return last in _SECRET_WORDS or (last == "key" and len(words) > 1
                                     and words[-2] in _KEY_QUALIFIERS)

# a value that is a secret whatever its name: well-known key formats, bearer strings,
# JWTs, and long runs of key-alphabet characters mixing letters and digits
_SECRET_VALUE = re.compile(
    r"(?:sk|pk|rk)-[A-Za-z0-9_-]{8,}|hf_[A-Za-z0-9]{16,}|gh[pousr]_[A-Za-z0-9]{20,}"
    r"|xox[abpr]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}|AIza[0-9A-Za-z_-]{30,}"
    r"|eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"
    r"|(?=[A-Za-z0-9+_=-]*[0-9])(?=[A-Za-z0-9+_=-]*[A-Za-z])[A-Za-z0-9+_=-]{32,}")


def redact_args(args: Iterable[str]) -> list[str]:
    """``args`` with the value of every secret-named option (``--api-key X``,
    ``--api-key=X``, ``HF_TOKEN=X``) and every key-looking value replaced."""
    out: list[str] = []
    hide_next = False
    for a in args:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name, eq, value = a.partition("=")
        if eq and secret_name(name):
            out.append(f"{name}={REDACTED}")
            continue
        if a.startswith("-") and not eq and secret_name(a):
            out.append(a)
            hide_next = True
            continue
        out.append(_SECRET_VALUE.sub(REDACTED, a))
    return out


def mask_token(token: bytes, salt: bytes) -> bytes:
    """What a capture stores in place of a secret: printable, as long as ``token``,
    the same for the same token and salt, and not reversible without the salt."""
    digest = hmac.new(salt, token, hashlib.sha256).hexdigest().encode()
    return (digest * (len(token) // len(digest) + 1))[: len(token)]


def token_span(value: bytes) -> tuple[int, int]:
    """Where the key is in a credential header's value: after an auth scheme
    (``Bearer``), without surrounding whitespace."""
    start, end = 0, len(value)
    while start < end and value[start] in b" \t":
        start += 1
    while end > start and value[end - 1] in b" \t":
        end -= 1
    for i in range(start, end):
        if value[i] in b" \t":
            start = i + 1
            while start < end and value[start] in b" \t":
                start += 1
            break
    return start, end


def open_private(path: str | os.PathLike[str], mode: str = "w", **kw: Any) -> IO[Any]:
    """``open(path, mode)`` for writing, the file created or truncated with mode 0600
    (an existing file is also set to 0600 before anything is written)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
    flags |= os.O_APPEND if "a" in mode else os.O_TRUNC
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, mode, **kw)
    except BaseException:
        os.close(fd)
        raise
