"""Uprobes attached only while they have something to tell.

Some probes learn something once and then only cost: the runtime's launch probes that
reveal host stubs (tracer/probes/stubnames.py), the driver's kernel-alias look-ups
that some libraries repeat before every launch (tracer/probes/lookups.py). Each pays a
uprobe trap per call, on the traced thread. A ``ProbeWindow`` keeps such probes
attached while they are *open*, and closes them (detached, on a thread of its own)
once their calls have gone on for ``quiet_s`` seconds with nothing new, or for ``max_s``
seconds in all. Only time in which the probes fired counts: a process that makes no
such call costs nothing and shows nothing, so a server attached while idle keeps the
window open for its first requests. Its owner opens it again when there may be
something new to learn (a new process, a handle launched with no name).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from tracer.probes.uprobes import Attached, Site, Uprobes

CHECK_S = 0.25  # how often the probes' call count is read while the window is open


class ProbeWindow:
    """A set of probe sites attached while the window is open."""

    def __init__(self, uprobes: Uprobes | None, errors: dict[str, str], label: str,
                 calls: Callable[[], int], quiet_s: float, max_s: float = 0.0,
                 enabled: bool = True, fires: str = "calls", news: str = "nothing new"
                 ) -> None:
        """``calls``: how many times the probes fired in all (a kernel counter);
        ``quiet_s`` 0: never closed for quiet; ``max_s`` 0: no limit; ``fires`` and
        ``news`` word the reasons for closing ("runtime launches", "no new host stub")."""
        self.uprobes = uprobes
        self.errors = errors
        self.label = label  # said in detach messages: "stub-naming-off"
        self.fires = fires
        self.nothing_new = news
        self._calls_now = calls
        self.quiet_s = quiet_s
        self.max_s = max_s
        self.enabled = enabled
        self.sites: dict[tuple[str, int, bool], Site] = {}  # (path, addr, ret) -> site
        self._moved: dict[str, str] = {}  # a file's old path -> the one to attach through
        self._groups: list[Attached] = []  # the probes attached in this window
        self._detacher: threading.Thread | None = None
        self.opened_at: float | None = None  # monotonic time; None while closed
        self.quiet_active = 0.0  # seconds with calls since the last news
        self.open_active = 0.0  # seconds with calls since the window opened
        self._calls = 0  # the kernel's count at the last check
        self._last_check = 0.0
        self.windows = 0  # times opened
        self.closed_why = ""
        self.opened_why = ""

    @property
    def open(self) -> bool:
        """Whether the probes are attached now."""
        return self.opened_at is not None

    @property
    def attached(self) -> set[tuple[str, int, bool]]:
        """(path, address, is-return) of the probes attached now (or parked while the
        agent is paused), by the paths their files are known by now."""
        if self.uprobes is None:
            return set()
        return {(self._path(s.path), s.vaddr, s.ret)
                for g in self._groups for s in self.uprobes.sites_of(g)}

    def _path(self, path: str) -> str:
        while path in self._moved:
            path = self._moved[path]
        return path

    def move_file(self, old: str, new: str) -> None:
        """The file at ``old`` (``/proc/PID/root/...`` of a process now gone) is to be
        attached through ``new`` from now on; probes attached now stay as they are."""
        if old == new:
            return
        self._moved[old] = new
        self.sites = {(self._path(path), addr, ret): dataclasses.replace(s, path=self._path(path))
                      for (path, addr, ret), s in self.sites.items()}

    def add_sites(self, sites: list[Site]) -> None:
        """More probe sites (a newly found library): attached at once if open."""
        for s in sites:
            self.sites.setdefault((s.path, s.vaddr, s.ret), s)
        if self.open:
            self._attach_all()

    def open_window(self, why: str) -> bool:
        """Attach the probes (again) and restart the quiet timer; whether the window
        was closed before."""
        if not self.enabled or not self.sites:
            return False
        now = time.monotonic()
        was_closed = self.opened_at is None
        if was_closed:
            self.opened_at = now
            self.windows += 1
            self.open_active = 0.0
            self.opened_why = why
            self._calls = self._calls_now()
            self._last_check = now
        self.quiet_active = 0.0
        self._attach_all()
        return was_closed

    def _attach_all(self) -> None:
        assert self.uprobes is not None
        self.join_detach()  # a window closed just before: its probes must be gone first
        attached = self.attached
        todo = [s for key, s in self.sites.items() if key not in attached]
        if todo:
            self._groups.append(self.uprobes.attach(todo, self.errors))

    def close_window(self, why: str, done: Callable[[float], None] | None = None) -> bool:
        """Detach the probes in the background (``done`` is called once they are gone);
        whether the window was open."""
        if self.opened_at is None:
            return False
        assert self.uprobes is not None
        groups, self._groups = self._groups, []
        self._detacher = self.uprobes.detach_in_background(groups, self.errors, self.label,
                                                           done=done)
        self.closed_why = why
        self.opened_at = None  # last: another thread reading state sees it all done
        return True

    def join_detach(self) -> None:
        """Wait for a detach under way (before re-attaching, or tearing down)."""
        if self._detacher is not None:
            self._detacher.join()
            self._detacher = None

    def news(self) -> None:
        """The probes told something new: the quiet timer starts again."""
        self.quiet_active = 0.0

    def due(self, now: float) -> str | None:
        """Why the window should close now (gone quiet, or busy too long), else None;
        reads the kernel's count at most every CHECK_S."""
        if self.opened_at is None or now - self._last_check < CHECK_S:
            return None
        calls = self._calls_now()
        if calls != self._calls:  # the probes fired since the last check
            busy = now - self._last_check
            self.quiet_active += busy
            self.open_active += busy
        self._calls, self._last_check = calls, now
        if self.quiet_s > 0 and self.quiet_active >= self.quiet_s:
            return f"{self.quiet_s:g} s of {self.fires} with {self.nothing_new}"
        if self.max_s > 0 and self.open_active >= self.max_s:
            return f"{self.max_s:g} s of {self.fires}"
        return None

    def state(self) -> dict[str, Any]:
        """What the window did, for reports and benchmarks."""
        return {"enabled": self.enabled, "open": self.open, "windows": self.windows,
                "quiet_s": self.quiet_s, "max_s": self.max_s,
                "busy_s": round(self.open_active, 3), "opened_why": self.opened_why,
                "closed_why": self.closed_why, "probe_sites": len(self.sites),
                "attached": len(self.attached)}
