"""Reading /proc: process identity, socket inodes and their addresses, listeners.

Everything here tolerates processes that vanish mid-read: a missing file gives an
empty answer, never an exception. ``root`` lets tests and containers point at another
procfs mount.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")

TCP_LISTEN = 0x0A
_LISTEN_HEX = "%02X" % TCP_LISTEN  # the st column of /proc/net/tcp
TCP_ESTABLISHED = 0x01


def _read(path: Path, binary: bool = False) -> str | bytes:
    try:
        return path.read_bytes() if binary else path.read_text()
    except (OSError, UnicodeDecodeError):
        return b"" if binary else ""


def comm(pid: int) -> str:
    return str(_read(PROC / str(pid) / "comm")).strip()


def cmdline(pid: int) -> tuple[str, ...]:
    raw = _read(PROC / str(pid) / "cmdline", binary=True)
    assert isinstance(raw, bytes)
    return tuple(a.decode("utf-8", "replace") for a in raw.split(b"\0") if a)


def exe(pid: int) -> str:
    try:
        return os.readlink(PROC / str(pid) / "exe")
    except OSError:
        return ""


def status_field(pid: int, name: str) -> str:
    for line in str(_read(PROC / str(pid) / "status")).splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return ""


def tgid_of(tid: int) -> int:
    """The process a thread belongs to (0 if it is gone)."""
    v = status_field(tid, "Tgid")
    return int(v) if v.isdigit() else 0


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_ns(pid: int) -> int | None:
    """CPU time a process has used, user and system, its exited threads' included
    (``/proc/PID/stat`` utime + stime, in clock ticks: 10 ms where USER_HZ is 100);
    None if it is gone."""
    text = str(_read(PROC / str(pid) / "stat"))
    # the fields after the command, which may itself hold spaces and parentheses
    fields = text[text.rfind(")") + 2:].split()
    if len(fields) < 13:
        return None
    try:
        return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // _CLK_TCK
    except ValueError:
        return None


def ppid(pid: int) -> int:
    v = status_field(pid, "PPid")
    return int(v) if v.isdigit() else 0


_CONTAINER_ID = re.compile(r"([0-9a-f]{64})")


def container_id(pid: int) -> str:
    """The container id from /proc/PID/cgroup (docker, containerd, cri-o), or ''."""
    for line in str(_read(PROC / str(pid) / "cgroup")).splitlines():
        m = _CONTAINER_ID.search(line.rsplit("/", 1)[-1]) or _CONTAINER_ID.search(line)
        if m:
            return m.group(1)
    return ""


def all_pids() -> list[int]:
    try:
        return [int(d) for d in os.listdir(PROC) if d.isdigit()]
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    """Live child processes of ``pid``, their children, and so on (an engine process a
    server started before the tracer attached)."""
    out: list[int] = []
    todo = [pid]
    while todo and len(out) < 4096:
        parent = todo.pop()
        kids: set[int] = set()
        try:
            tasks = os.listdir(PROC / str(parent) / "task")
        except OSError:
            continue
        for t in tasks:
            for c in str(_read(PROC / str(parent) / "task" / t / "children")).split():
                if c.isdigit():
                    kids.add(int(c))
        for c in sorted(kids - set(out)):
            out.append(c)
            todo.append(c)
    return out


def pids_by_comm(name: str) -> list[int]:
    """Processes whose comm (first 15 bytes of the program name) equals ``name``."""
    want = name[:15]
    return [p for p in all_pids() if comm(p) == want]


def socket_fds(pid: int) -> dict[int, int]:
    """fd -> socket inode for every socket the process has open."""
    out: dict[int, int] = {}
    fd_dir = PROC / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(name)] = int(target[8:-1])
    return out


def fd_inode(pid: int, fd: int) -> int:
    try:
        target = os.readlink(PROC / str(pid) / "fd" / str(fd))
    except OSError:
        return 0
    return int(target[8:-1]) if target.startswith("socket:[") else 0


@dataclass(frozen=True)
class SockEntry:
    """One row of /proc/net/{tcp,tcp6,unix}."""

    inode: int
    family: int
    local_addr: str
    local_port: int
    peer_addr: str
    peer_port: int
    state: int


def _hex_addr(text: str) -> tuple[str, int]:
    addr_hex, port_hex = text.split(":")
    raw = bytes.fromhex(addr_hex)
    port = int(port_hex, 16)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(struct.pack("<I", struct.unpack(">I", raw)[0]))), port
    # IPv6 is four host-order 32-bit words
    words = struct.unpack(">4I", raw)
    v6 = ipaddress.IPv6Address(struct.pack("<4I", *words))
    return str(v6.ipv4_mapped or v6), port


def inet_sockets(pid: int, listening: bool = False) -> dict[int, SockEntry]:
    """inode -> TCP socket entry, from the process's network namespace; ``listening``:
    the listening sockets only. The namespace's table lists every socket of the host's
    (or the pod's) connections, thousands of them on a busy node, many in TIME_WAIT:
    the state is looked at before the addresses are parsed, which cost the most."""
    out: dict[int, SockEntry] = {}
    for name, fam in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        text = str(_read(PROC / str(pid) / "net" / name))
        for line in text.splitlines()[1:]:
            if listening and line.split(None, 4)[3:4] != [_LISTEN_HEX]:
                continue
            cols = line.split()
            if len(cols) < 10:
                continue
            try:
                la, lp = _hex_addr(cols[1])
                ra, rp = _hex_addr(cols[2])
                out[int(cols[9])] = SockEntry(int(cols[9]), fam, la, lp, ra, rp, int(cols[3], 16))
            except ValueError:
                continue
    return out


def unix_sockets(pid: int) -> dict[int, SockEntry]:
    """inode -> unix socket entry (path as local_addr; state 1=listening flag)."""
    out: dict[int, SockEntry] = {}
    text = str(_read(PROC / str(pid) / "net" / "unix"))
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 7:
            continue
        try:
            inode = int(cols[6])
            flags = int(cols[3], 16)
        except ValueError:
            continue
        path = cols[7] if len(cols) > 7 else ""
        listening = 1 if flags & 0x10000 else 0  # __SO_ACCEPTCON
        out[inode] = SockEntry(inode, socket.AF_UNIX, path, 0, "", 0, listening)
    return out


def netns(pid: int) -> str | None:
    """The process's network namespace (``net:[inode]``), None if it is gone."""
    try:
        return os.readlink(PROC / str(pid) / "ns" / "net")
    except OSError:
        return None


def pids_listening_on(port: int) -> list[int]:
    """Processes holding a TCP socket listening on ``port`` (any address)."""
    listeners: set[int] = set()
    seen_ns: set[str] = set()
    pids = all_pids()
    for pid in pids:
        ns = netns(pid)
        if ns is None or ns in seen_ns:
            continue
        seen_ns.add(ns)
        for e in inet_sockets(pid, listening=True).values():
            if e.local_port == port:
                listeners.add(e.inode)
    if not listeners:
        return []
    return [p for p in pids if listeners & set(socket_fds(p).values())]


def maps(pid: int) -> tuple[str, ...]:
    """Paths of the files mapped executable into the process, in map order, deduplicated."""
    seen: dict[str, None] = {}
    for line in str(_read(PROC / str(pid) / "maps")).splitlines():
        cols = line.split(None, 5)
        if len(cols) == 6 and "x" in cols[1] and cols[5].startswith("/"):
            seen.setdefault(cols[5], None)
    return tuple(seen)


@dataclass(frozen=True)
class Mapping:
    """One line of /proc/PID/maps that maps a file."""

    start: int
    end: int
    perms: str
    offset: int  # file offset of ``start``
    inode: int
    path: str


def mappings(pid: int) -> list[Mapping]:
    """The file-backed mappings of ``pid`` (empty if it is gone)."""
    out = []
    for line in str(_read(PROC / str(pid) / "maps")).splitlines():
        cols = line.split(None, 5)
        if len(cols) < 6 or not cols[5].startswith("/"):
            continue
        lo, hi = cols[0].split("-")
        out.append(Mapping(int(lo, 16), int(hi, 16), cols[1], int(cols[2], 16),
                           int(cols[4]), cols[5]))
    return out


def open_mapped(pid: int, m: Mapping) -> str:
    """A path that opens the file ``pid`` maps at ``m``: through the process's root,
    else (deleted or replaced since it was mapped) the kernel's handle on the mapping
    itself."""
    path = f"/proc/{pid}/root{m.path}"
    try:
        if os.stat(path).st_ino == m.inode:
            return path
    except OSError:
        pass
    return f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}"


def mapping_of(pid: int, addr: int) -> Mapping | None:
    """The file mapping of ``pid`` that holds ``addr``, or None."""
    for m in mappings(pid):
        if m.start <= addr < m.end:
            return m
    return None
