"""Whether a library's read-only data holds a string: the second evidence for a kernel
name read from a driver object when no cubin of the process holds it.

cuBLASLt (CUDA 13) loads kernels whose names are in none of its cubins: its
``cutlass_80_simt_*`` kernels' mangled names sit in its ``.rodata`` as plain strings,
and its ``nvjet_sm90_*`` names are built at run time from printf formats kept there
(``nvjet_sm90_%s_%dx%d_...``). A name is confirmed when its library's ``.rodata``
holds it as a whole NUL-terminated string, or matches one of those formats whose
fixed text is long enough to be specific (``MIN_LITERAL`` characters before the first
conversion). The evidence is weaker than a cubin's symbol table, so names confirmed
here carry a source of their own (``NAME_DRIVER_STRING``).
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass, field

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

MIN_LITERAL = 8  # fixed characters a format must start with to be used
MAX_FORMATS = 4096  # formats kept per library
MAX_WORD_PIECES = 4  # formats with more separate %s runs are not used (matching cost)
_FORMAT = re.compile(rb"[A-Za-z_][A-Za-z0-9_]{%d,}%%[-0-9A-Za-z_%%]{1,200}\x00" % (MIN_LITERAL - 1))
_CONVERSION = re.compile(r"%(%|[-0-9.]*(?:l|ll|h|z)?[sdiuxXc])")
# numbers possessive; a run of %s (nvjet's formats have ten in a row, each argument
# with its own leading "_") becomes one piece, so that matching backtracks over a few
# pieces, not ten
_WORDS = r"[A-Za-z0-9_]*"
_PIECE = {"s": _WORDS, "d": r"-?\d++", "i": r"-?\d++", "u": r"\d++",
          "x": r"[0-9a-f]++", "X": r"[0-9A-F]++", "c": r"[A-Za-z0-9_]"}


def format_regex(fmt: str) -> re.Pattern[str] | None:
    """A regex matching what ``printf(fmt, ...)`` can make of plain words and numbers,
    or None if ``fmt`` has a conversion it does not know."""
    out, pos = [], 0
    for m in _CONVERSION.finditer(fmt):
        if m.start() > pos:
            out.append(re.escape(fmt[pos:m.start()]))
        conv = m.group(1)
        if conv == "%":
            out.append("%")
        else:
            piece = _PIECE.get(conv[-1])
            if piece is None:
                return None
            if not (piece == _WORDS and out and out[-1] == _WORDS):
                out.append(piece)
        pos = m.end()
    if "%" in fmt[pos:] or out.count(_WORDS) > MAX_WORD_PIECES:
        return None
    out.append(re.escape(fmt[pos:]))
    return re.compile("".join(out))


@dataclass
class LibraryStrings:
    """One library file's ``.rodata``, searched on demand (read through mmap)."""

    path: str
    _range: tuple[int, int] | None = None
    _formats: list[re.Pattern[str]] | None = None
    _cache: dict[str, bool] = field(default_factory=dict)

    def _rodata(self) -> tuple[int, int] | None:
        if self._range is None:
            try:
                with open(self.path, "rb") as f:
                    sec = ELFFile(f).get_section_by_name(".rodata")
                    size = os.fstat(f.fileno()).st_size
            except (OSError, ELFError, ValueError):
                self._range = (0, 0)
                return None
            if sec is None or sec["sh_type"] == "SHT_NOBITS":
                self._range = (0, 0)
            else:
                start = sec["sh_offset"]
                self._range = (start, min(size, start + sec["sh_size"]))
        return self._range if self._range[1] > self._range[0] else None

    def holds(self, name: str) -> bool:
        """Whether ``name`` is a whole string of the ``.rodata``, or matches a format."""
        if name in self._cache:
            return self._cache[name]
        if not name or len(name) > 256:
            return False
        got = False
        rng = self._rodata()
        if rng is not None:
            try:
                with open(self.path, "rb") as f, \
                        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    got = mm.find(b"\0" + name.encode() + b"\0", rng[0] - 1, rng[1] + 1) >= 0
                    if not got:
                        if self._formats is None:
                            self._formats = self._read_formats(mm, *rng)
                        got = any(p.fullmatch(name) for p in self._formats)
            except (OSError, ValueError, UnicodeEncodeError):
                got = False
        self._cache[name] = got
        return got

    @staticmethod
    def _read_formats(mm: mmap.mmap, start: int, end: int) -> list[re.Pattern[str]]:
        out = []
        for m in _FORMAT.finditer(mm, start, end):
            if mm[m.start() - 1:m.start()] not in (b"\0", b""):
                continue  # the tail of a longer string
            p = format_regex(m.group()[:-1].decode("ascii", "replace"))
            if p is not None:
                out.append(p)
                if len(out) >= MAX_FORMATS:
                    break
        return out
