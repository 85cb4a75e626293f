"""Attach the TLS probes (bpf/tls.c) to the TLS libraries each traced process maps.

Libraries are found per process in ``/proc/PID/maps`` (as the GPU libraries are) and
opened through ``/proc/PID/root``. OpenSSL 1.1 and 3.x are probed: ``libssl`` for the
SSL calls, the ``libcrypto`` it links for BIO_read/BIO_write (how an SSL object on
memory BIOs is tied to its socket). A libssl is recognised by its symbol versions
(``OPENSSL_3.*``, ``OPENSSL_1_1_*``), not by its file name alone; one of another
version, another TLS library (GnuTLS, NSS...), or a TLS library linked into a binary
without symbols (BoringSSL inside grpcio) is not probed: it is reported (a
``TlsLibrary`` event with the reason, ``tls.libraries_not_probed``), and its connections
show up as TLS seen only as ciphertext (``tls_connections_unseen``). A wrong probe is
worse than none.

Where OpenSSL implements a pair of calls as thin wrappers of one internal function
(``SSL_read`` and ``SSL_read_ex`` both call ``ssl_read_internal(s, buf, num, &n)``;
``SSL_write``/``SSL_write_ex``; ``BIO_write``/``BIO_write_ex``), the probe goes on that
internal function instead, when the bytes prove it (``forwarded_sites``): the exported
functions begin with ``sub $n,%rsp``, which the kernel single-steps (~10 us a hit on the
development VM), the internal ones with ``push``, which it emulates (~1-2 us).

libssl is on nearly every host and used by nearly every process, so the probes are
attached per traced process (uprobe_multi links limited to its pid): the kernel puts
the breakpoints into that process's pages only, and other processes using the same
library pay nothing. Where the kernel has no uprobe_multi links, perf-event uprobes
with the same pid filter are used.
"""

from __future__ import annotations

import mmap
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from elftools.common.exceptions import ELFError
from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile

from tracer.events import wire
from tracer.events.tls import TlsLibrary
from tracer.probes import procfs
from tracer.probes.entry import ENDBR64, entry_site, file_offset
from tracer.probes.gpu import _VERSYM_HIDDEN, Probe, exported_functions
from tracer.probes.uprobes import Attached, Site, Uprobes

C = wire.CONSTANTS

# libssl: the plaintext boundary. SSL_accept and SSL_connect jump to SSL_do_handshake
# (through the PLT: it is exported), so probing it sees all three; one return handler
# serves every call (the in-flight entry says what the call was).
SSL_PROBES: list[Probe] = [
    Probe("SSL_read", "tt_tls_read", "tt_tls_return"),
    Probe("SSL_read_ex", "tt_tls_read_ex", "tt_tls_return"),
    Probe("SSL_write", "tt_tls_write", "tt_tls_return"),
    Probe("SSL_write_ex", "tt_tls_write_ex", "tt_tls_return"),
    # OpenSSL 3.3+ (SSL_write_ex calls it there: the outer call is the one counted)
    Probe("SSL_write_ex2", "tt_tls_write_ex2", "tt_tls_return"),
    Probe("SSL_do_handshake", "tt_tls_handshake", "tt_tls_return"),
    Probe("SSL_set_fd", "tt_tls_set_fd"),
    Probe("SSL_set_bio", "tt_tls_set_bio"),
    Probe("SSL_free", "tt_tls_free"),
]
# Without these the plaintext or an object's end would be missed: not probed at all.
REQUIRED = frozenset({"SSL_read", "SSL_write", "SSL_do_handshake", "SSL_free"})

# libcrypto: BIO_write, which OpenSSL's record layer calls for each record it writes
# (1.1 and 3.x alike) and Python's ssl.MemoryBIO calls to feed a read BIO; BIO_read,
# which it calls twice per record read: only where probed cheaply (CHEAP_ONLY), for
# objects set up before attach on memory BIOs.
CRYPTO_PROBES: list[Probe] = [
    Probe("BIO_write", "tt_tls_bio_write"),
    Probe("BIO_write_ex", "tt_tls_bio_write"),
    Probe("BIO_read", "tt_tls_bio_read"),
    Probe("BIO_read_ex", "tt_tls_bio_read"),
]
CHEAP_ONLY = frozenset({"BIO_read", "BIO_read_ex"})

LIBSSL = re.compile(r"/libssl(?:-[0-9a-f]{8})?\.so(?:\.[0-9][0-9a-z.]*)?$")
LIBCRYPTO = re.compile(r"/libcrypto(?:-[0-9a-f]{8})?\.so(?:\.[0-9][0-9a-z.]*)?$")
# other TLS libraries, recognised so that they are said, not probed
OTHER_TLS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"/libgnutls\.so(?:\.\d+)*$"), "GnuTLS"),
    (re.compile(r"/libssl3\.so$"), "NSS"),
    (re.compile(r"/libwolfssl\.so(?:\.\d+)*$"), "wolfSSL"),
    (re.compile(r"/libmbedtls\.so(?:\.\d+)*$"), "Mbed TLS"),
    (re.compile(r"/libs2n\.so(?:\.\d+)*$"), "s2n-tls"),
]
# binaries known to carry a TLS library of their own, linked in
STATIC_TLS = re.compile(r"/cygrpc\.[^/]*\.so$|/libgrpc[^/]*\.so(?:\.\d+)*$")
_OPENSSL_VERSION = re.compile(rb"OpenSSL (\d+\.\d+\.\d+[a-z]?)[ -]")

COUNTER_NAMES: dict[int, str] = {
    v: k[len("TLS_CNT_"):].lower() for k, v in C.items() if k.startswith("TLS_CNT_")
}


# (wrapper with the internal function's signature, the other wrapper): probed at the
# internal function both call, when forwarded_sites() can prove it
FORWARDED = (("SSL_read_ex", "SSL_read"), ("SSL_write_ex", "SSL_write"),
             ("BIO_write_ex", "BIO_write"), ("BIO_read_ex", "BIO_read"))


@dataclass(frozen=True)
class ProbeSite:
    """Where one probed call's handlers go: ``vaddr`` in the file; ``covers`` the
    exported functions whose calls pass there."""

    vaddr: int
    entry: str | None
    ret: str | None
    name: str
    covers: tuple[str, ...]


@dataclass
class LibraryFile:
    """What one libssl file is (cached per file)."""

    name: str  # "OpenSSL 3.0.19"
    status: str  # as TlsLibrary.status
    reason: str = ""
    sites: list[ProbeSite] = field(default_factory=list)
    crypto_soname: str = ""  # the libcrypto it links (DT_NEEDED)
    forwarded: list[str] = field(default_factory=list)  # pairs probed at their internal


def _elf_dynamic(elf: ELFFile) -> tuple[str, list[str]]:
    """(DT_SONAME, DT_NEEDED names) of an ELF file."""
    soname, needed = "", []
    for sec in elf.iter_sections():
        if isinstance(sec, DynamicSection):
            for tag in sec.iter_tags():
                if tag.entry.d_tag == "DT_SONAME":
                    soname = tag.soname
                elif tag.entry.d_tag == "DT_NEEDED":
                    needed.append(tag.needed)
    return soname, needed


def _version_names(elf: ELFFile) -> list[str]:
    """The symbol versions an ELF file defines (.gnu.version_d)."""
    sec = elf.get_section_by_name(".gnu.version_d")
    if sec is None:
        return []
    return [next(aux).name for _, aux in sec.iter_versions()]


def openssl_family(versions: list[str]) -> str | None:
    """"3" or "1.1" for a libssl defining OpenSSL's symbol versions of that series;
    None for anything else (OpenSSL 1.0 and older, LibreSSL, BoringSSL, a fork)."""
    if any(v.startswith("OPENSSL_3.") for v in versions):
        return "3"
    if any(v.startswith("OPENSSL_1_1_") for v in versions):
        return "1.1"
    return None


def openssl_version(path: str) -> str | None:
    """The version an OpenSSL library file names in its text ("3.0.19"), or None."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            pos = m.find(b"OpenSSL ")
            while pos >= 0:
                hit = _OPENSSL_VERSION.match(m[pos:pos + 40])
                if hit:
                    return hit.group(1).decode()
                pos = m.find(b"OpenSSL ", pos + 1)
    except (OSError, ValueError):
        return None
    return None


_PUSH = range(0x50, 0x58)
_ARGS = (7, 6, 2, 1)  # rdi, rsi, rdx, rcx: the argument registers the handlers read


def prologue_call(code: bytes) -> int | None:
    """The offset (from the function's start) of the function ``code`` calls first, if
    every instruction before that call leaves the argument registers as they came:
    ENDBR64, ``push``, ``sub $n,%rsp``, and register-to-register ``mov`` into a register
    other than rdi, rsi, rdx, rcx. Anything else: None (nothing is guessed)."""
    i = 0
    while i < min(len(code), 48):
        b = code[i]
        if code[i:i + 4] == ENDBR64:
            i += 4
        elif b in _PUSH:
            i += 1
        elif b == 0x41 and i + 1 < len(code) and code[i + 1] in _PUSH:
            i += 2
        elif code[i:i + 3] == b"\x48\x83\xec":
            i += 4
        elif code[i:i + 3] == b"\x48\x81\xec":
            i += 7
        elif b in (0x48, 0x49, 0x4C, 0x4D) and code[i + 1:i + 2] == b"\x89" and i + 2 < len(code):
            modrm = code[i + 2]
            dest = (modrm & 7) | (8 if b & 1 else 0)  # REX.B extends the r/m register
            if modrm >> 6 != 3 or dest in _ARGS:
                return None
            i += 3
        elif b == 0xE8 and i + 5 <= len(code):
            return i + 5 + int.from_bytes(code[i + 1:i + 5], "little", signed=True)
        else:
            return None
    return None


def _calls(code: bytes, start: int, target: int) -> bool:
    """Whether ``code`` (a function at ``start``) has a ``call rel32`` to ``target``."""
    i = code.find(b"\xe8")
    while 0 <= i <= len(code) - 5:
        if start + i + 5 + int.from_bytes(code[i + 1:i + 5], "little", signed=True) == target:
            return True
        i = code.find(b"\xe8", i + 1)
    return False


def _functions(elf: ELFFile) -> dict[str, tuple[int, int]]:
    """Defined dynamic functions (default symbol versions) -> (address, size)."""
    out: dict[str, tuple[int, int]] = {}
    dynsym = elf.get_section_by_name(".dynsym")
    if dynsym is None:
        return out
    versym = elf.get_section_by_name(".gnu.version")
    for i, sym in enumerate(dynsym.iter_symbols()):
        if sym["st_info"]["type"] != "STT_FUNC" or sym["st_shndx"] == "SHN_UNDEF":
            continue
        if versym is not None:
            ndx = versym.get_symbol(i)["ndx"]
            if isinstance(ndx, int) and ndx & _VERSYM_HIDDEN:
                continue
        out.setdefault(sym.name, (sym["st_value"], sym["st_size"]))
    return out


def _code(elf: ELFFile, stream: Any, vaddr: int, size: int) -> bytes:
    off = file_offset(elf, vaddr)
    if off is None:
        return b""
    stream.seek(off)
    return stream.read(size)


def forwarded_sites(path: str, probes: list[Probe]) -> tuple[list[ProbeSite], list[str]]:
    """Where ``probes`` go in the ELF file at ``path``: each exported function at its
    entry (past an ENDBR64), except a FORWARDED pair proved to be wrappers of one
    internal function that starts with an emulated ``push``: then that function, once,
    with the ``_ex`` wrapper's handlers (its signature). CHEAP_ONLY functions are
    probed that way or not at all. Proof: the ``_ex`` wrapper's
    first call, before which no argument register is touched (``prologue_call``), goes
    to that function, and the other wrapper calls it too. Returns the sites and the
    pairs forwarded."""
    by_name = {p.symbol: p for p in probes}
    out: list[ProbeSite] = []
    done: set[str] = set()
    forwarded: list[str] = []
    with open(path, "rb") as f:
        elf = ELFFile(f)
        funcs = _functions(elf)
        for ex, plain in FORWARDED:
            if ex not in by_name or plain not in by_name or ex not in funcs or plain not in funcs:
                continue
            (ex_at, ex_size), (plain_at, plain_size) = funcs[ex], funcs[plain]
            rel = prologue_call(_code(elf, f, ex_at, min(ex_size, 48)))
            if rel is None:
                continue
            target = ex_at + rel
            head = _code(elf, f, target, 6)
            site = target + 4 if head.startswith(ENDBR64) else target
            first = head[site - target:]
            if not first or not (first[0] in _PUSH or (first[0] == 0x41 and first[1:2]
                                                         and first[1] in _PUSH)):
                continue  # not emulated: no cheaper than the wrappers
            if not _calls(_code(elf, f, plain_at, plain_size), plain_at, target):
                continue
            p = by_name[ex]
            out.append(ProbeSite(site, p.entry, p.ret, f"{plain}+{ex}@{target:#x}", (plain, ex)))
            done.update((ex, plain))
            forwarded.append(f"{plain}/{ex}")
        for p in probes:
            if p.symbol in done or p.symbol not in funcs or p.symbol in CHEAP_ONLY:
                continue
            out.append(ProbeSite(entry_site(elf, f, funcs[p.symbol][0]), p.entry, p.ret,
                                 p.symbol, (p.symbol,)))
    return out, forwarded


def classify_libssl(path: str) -> LibraryFile:
    """Whether the libssl at ``path`` can be probed, and where."""
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            soname, needed = _elf_dynamic(elf)
            versions = _version_names(elf)
    except (OSError, ELFError) as e:
        return LibraryFile("libssl", "error", f"cannot read it: {e}")
    family = openssl_family(versions)
    label = soname or os.path.basename(path)
    if family is None:
        return LibraryFile(f"unknown ({label})", "unknown_version",
                           f"{label} defines no OpenSSL 1.1 or 3.x symbol versions "
                           f"({', '.join(versions[1:4]) or 'none'}): only those are probed")
    try:
        sites, forwarded = forwarded_sites(path, SSL_PROBES)
    except (OSError, ELFError) as e:
        return LibraryFile(f"OpenSSL {family}", "error", f"cannot read its symbols: {e}")
    missing = sorted(REQUIRED - {c for s in sites for c in s.covers})
    if missing:
        return LibraryFile(f"OpenSSL {family}", "unknown_version",
                           f"{label} lacks {', '.join(missing)}")
    crypto = next((n for n in needed if n.startswith("libcrypto")), "")
    return LibraryFile(f"OpenSSL {family}", "probed", "", sites, crypto, forwarded)


def static_tls(path: str) -> str | None:
    """For a binary known to link a TLS library in (grpcio): why it is not probed, or
    None when it exports the SSL functions (then it is probed like a libssl)."""
    try:
        if "SSL_read" in exported_functions(path):
            return None
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            boring = m.find(b"boringssl") >= 0 or m.find(b"BoringSSL") >= 0
    except (OSError, ELFError, ValueError) as e:
        return f"cannot read it: {e}"
    what = "BoringSSL" if boring else "a TLS library"
    return (f"{what} linked into this binary with no symbols for its SSL functions "
            "(stripped, hidden): its plaintext is not seen")


class TlsProbes:
    """Finds TLS libraries in traced processes and attaches the TLS probes to each
    process's own copy (per-pid links)."""

    def __init__(self, bpf: Any, uprobes: Uprobes) -> None:
        self.bpf = bpf
        self.uprobes = uprobes
        self.errors: dict[str, str] = {}
        self._files: dict[tuple[int, int], LibraryFile] = {}  # (dev, inode) -> what it is
        self._static: dict[tuple[int, int], str | None] = {}
        self._crypto: dict[tuple[int, int], list[ProbeSite]] = {}
        self._seen: dict[int, set[str]] = {}  # pid -> mapped paths already looked at
        self.attached: dict[int, list[Attached]] = {}  # pid -> its links
        self.libraries: dict[tuple[int, str], TlsLibrary] = {}  # (pid, path) -> found
        self._detachers: list[threading.Thread] = []

    def scan(self, pid: int) -> list[TlsLibrary]:
        """Look at the TLS libraries ``pid`` maps that were not looked at yet; attach to
        those that can be probed. Returns what was found, probed or not."""
        mapped = procfs.maps(pid)
        seen = self._seen.setdefault(pid, set())
        new = [p for p in mapped if p not in seen]
        if not new:
            return []
        seen.update(new)
        out = []
        for path in new:
            if LIBSSL.search(path):
                out.append(self._libssl(pid, path, mapped))
            elif STATIC_TLS.search(path):
                lib = self._static_tls(pid, path)
                if lib is not None:
                    out.append(lib)
            else:
                for pattern, name in OTHER_TLS:
                    if pattern.search(path):
                        out.append(self._found(pid, path, name, "unsupported",
                                               f"{name} is not probed (OpenSSL 1.1 and 3.x are)"))
        return out

    def _found(self, pid: int, path: str, name: str, status: str, reason: str = "",
               crypto: str = "") -> TlsLibrary:
        lib = TlsLibrary(pid=pid, ts=time.monotonic_ns(), path=path, name=name, status=status,
                         reason=reason, crypto_path=crypto)
        self.libraries[(pid, path)] = lib
        return lib

    def _key(self, path: str) -> tuple[int, int] | None:
        try:
            st = os.stat(path)
        except OSError as e:
            self.errors[path] = str(e)
            return None
        return (st.st_dev, st.st_ino)

    def _static_tls(self, pid: int, path: str) -> TlsLibrary | None:
        opened = f"/proc/{pid}/root{path}"
        key = self._key(opened)
        if key is None:
            return None
        if key not in self._static:
            self._static[key] = static_tls(opened)
        why = self._static[key]
        if why is None:
            return self._libssl(pid, path, procfs.maps(pid))  # exports SSL_*: probe it
        name = "BoringSSL" if why.startswith("BoringSSL") else "TLS library"
        return self._found(pid, path, name, "no_symbols", why)

    def _libssl(self, pid: int, path: str, mapped: tuple[str, ...]) -> TlsLibrary:
        opened = f"/proc/{pid}/root{path}"
        key = self._key(opened)
        if key is None:
            return self._found(pid, path, "libssl", "error", self.errors.get(opened, ""))
        info = self._files.get(key)
        if info is None:
            info = self._files[key] = classify_libssl(opened)
        if info.status != "probed":
            return self._found(pid, path, info.name, info.status, info.reason)
        crypto = self._crypto_path(mapped, info.crypto_soname)
        version = openssl_version(f"/proc/{pid}/root{crypto}") if crypto else None
        name = f"OpenSSL {version}" if version else info.name
        covers = {ps.name: ps.covers for ps in info.sites}
        sites = [Site(opened, ps.vaddr, ps.entry, False, ps.name, pid)
                 for ps in info.sites if ps.entry]
        sites += [Site(opened, ps.vaddr, ps.ret, True, ps.name, pid)
                  for ps in info.sites if ps.ret]
        reason = ""
        if crypto:
            sites += self._crypto_sites(pid, crypto)
        else:
            reason = (f"its libcrypto ({info.crypto_soname or '?'}) is not mapped: SSL objects "
                      "on memory BIOs are not tied to their sockets")
        got = self.uprobes.attach(sites, self.errors)
        self.attached.setdefault(pid, []).append(got)
        failed = len(sites) - len(got)
        if failed:
            reason = ((reason + "; " if reason else "")
                      + f"{failed} of {len(sites)} probes not attached")
        seen = {c for s in got.sites for c in covers.get(s.name, ())}
        status = "probed" if REQUIRED <= seen else "error"
        if status == "probed":
            self._mark(pid)
        return self._found(pid, path, name, status, reason, crypto)

    def _mark(self, pid: int) -> None:
        """Tell the socket probes ``pid`` does TLS now, not at its first SSL call after
        attach: the socket read that comes before that call (a connection from before
        attach: ciphertext read, then fed to the SSL object) must be remembered too."""
        import ctypes
        try:
            self.bpf[b"tls_procs"][ctypes.c_uint32(pid)] = ctypes.c_uint32(1)
        except Exception as e:  # a full map: the kernel marks it at its first SSL call
            self.errors[f"pid {pid}"] = f"tls_procs: {e}"

    def _crypto_path(self, mapped: tuple[str, ...], soname: str) -> str:
        """The libcrypto the process maps for a libssl that needs ``soname``."""
        same = [p for p in mapped if os.path.basename(p) == soname] if soname else []
        any_ = [p for p in mapped if LIBCRYPTO.search(p)]
        return (same or any_ or [""])[0]

    def _crypto_sites(self, pid: int, path: str) -> list[Site]:
        opened = f"/proc/{pid}/root{path}"
        key = self._key(opened)
        if key is None:
            return []
        if key not in self._crypto:
            try:
                self._crypto[key] = forwarded_sites(opened, CRYPTO_PROBES)[0]
            except (OSError, ELFError) as e:
                self.errors[opened] = f"cannot read its symbols: {e}"
                self._crypto[key] = []
        return [Site(opened, ps.vaddr, ps.entry, False, ps.name, pid)
                for ps in self._crypto[key] if ps.entry]

    def forget(self, pid: int) -> None:
        """``pid`` exited: drop its links (on a thread: each close waits a grace period)."""
        self._seen.pop(pid, None)
        import ctypes
        try:
            del self.bpf[b"tls_procs"][ctypes.c_uint32(pid)]
        except KeyError:
            pass
        groups = self.attached.pop(pid, [])
        if groups:
            self._detachers.append(self.uprobes.detach_in_background(groups, self.errors,
                                                                     f"tls-{pid}"))
        self._detachers = [t for t in self._detachers if t.is_alive()]

    def close(self) -> float:
        """Detach every TLS probe; the seconds it took."""
        t0 = time.perf_counter()
        for t in self._detachers:
            t.join()
        groups = [g for gs in self.attached.values() for g in gs]
        self.attached.clear()
        self.uprobes.detach(groups, self.errors)
        return time.perf_counter() - t0

    def counters(self) -> dict[str, int]:
        """The kernel's TLS counters (``tls.<name>``) and what was found (user space)."""
        out: dict[str, int] = {}
        table = self.bpf[b"tls_counters"]
        import ctypes
        for idx, name in COUNTER_NAMES.items():
            out[f"tls.{name}"] = int(sum(table[ctypes.c_int(idx)]))
        out["tls.attach_errors"] = len(self.errors)
        return out
