"""A team's file storage quota: what it holds and reserves, and whether one more upload fits (pure; no I/O).

    usage = reserve(usage, quota, "up-1", 5 << 20, now)     # a hold for an upload starting: QuotaExceeded if not
    usage = reserve(usage, quota, "up-1", 8 << 20, now)     # the same upload growing (chunked: no Content-Length)
    usage = commit(usage, "up-1", "file-...", 11 << 20)     # it is stored: the hold becomes the file
    usage = release(usage, "up-1")                           # or it failed: the hold goes
    usage = remove_file(usage, "file-...")                   # a delete (again: nothing)

``TeamUsage`` is one JSON record per team, written by compare-and-set (shared/file_ledger.py), so edges racing
for the last bytes of a quota cannot both pass it. A hold is an upload in progress: it counts against the quota
as a file and its bytes until it is committed, released, or its ``until`` passes (an edge that died
mid-upload holds nothing for long). The record keeps each file's id, so a commit or a delete done twice counts
once.
"""

from __future__ import annotations

from typing import Literal

from msgspec import Struct, field

QuotaKind = Literal["bytes", "files"]
DEFAULT_TEAM_FILE_BYTES = 10 << 30  # 10 GiB of files per team
DEFAULT_TEAM_FILES = 1000
HOLD_S = 660.0  # an upload's hold lasts the edge's upload timeout (600 s) and a margin; each step renews it


class FileQuota(Struct, frozen=True):
    max_bytes: int = DEFAULT_TEAM_FILE_BYTES
    max_files: int = DEFAULT_TEAM_FILES


class Hold(Struct, frozen=True):
    bytes: int
    until: float  # unix seconds


class TeamUsage(Struct, frozen=True):
    """A team's stored files (id -> bytes) and its uploads in progress (upload id -> Hold)."""

    files: dict[str, int] = field(default_factory=dict)
    holds: dict[str, Hold] = field(default_factory=dict)

    def live(self, now: float) -> "TeamUsage":
        """Without the holds whose time has passed."""
        return TeamUsage(self.files, {k: h for k, h in self.holds.items() if h.until > now})

    def used_bytes(self) -> int:
        return sum(self.files.values()) + sum(h.bytes for h in self.holds.values())

    def used_files(self) -> int:
        return len(self.files) + len(self.holds)


class QuotaExceeded(Exception):
    """``requested`` more would pass the team's quota of ``kind``: ``used`` of ``limit`` are taken."""

    def __init__(self, kind: QuotaKind, limit: int, used: int, requested: int) -> None:
        super().__init__(f"{kind}: {used} used + {requested} requested > {limit}")
        self.kind, self.limit, self.used, self.requested = kind, limit, used, requested


def reserve(usage: TeamUsage, quota: FileQuota, upload_id: str, more_bytes: int, now: float,
            hold_s: float = HOLD_S, enforce: bool = True, wanted_bytes: int = 0) -> TeamUsage:
    """``usage`` with the upload's hold grown by ``more_bytes`` (made if new; renewed to ``now + hold_s``), or by
    up to ``wanted_bytes`` where they fit (an upload of unknown length holds a step ahead). QuotaExceeded if
    ``more_bytes`` do not fit (``enforce=False`` counts them anyway: output the team already paid for)."""
    usage = usage.live(now)
    held = usage.holds.get(upload_id)
    if enforce:
        if held is None and usage.used_files() + 1 > quota.max_files:
            raise QuotaExceeded("files", quota.max_files, usage.used_files(), 1)
        if usage.used_bytes() + more_bytes > quota.max_bytes:
            raise QuotaExceeded("bytes", quota.max_bytes, usage.used_bytes(), more_bytes)
        more_bytes = max(more_bytes, min(wanted_bytes, quota.max_bytes - usage.used_bytes()))
    grown = Hold((held.bytes if held else 0) + more_bytes, now + hold_s)
    return TeamUsage(usage.files, {**usage.holds, upload_id: grown})


def commit(usage: TeamUsage, upload_id: str, file_id: str, size: int) -> TeamUsage:
    """The upload is a stored file of ``size`` bytes: its hold goes, the file counts."""
    return TeamUsage({**usage.files, file_id: size}, {k: h for k, h in usage.holds.items() if k != upload_id})


def release(usage: TeamUsage, upload_id: str) -> TeamUsage:
    return TeamUsage(usage.files, {k: h for k, h in usage.holds.items() if k != upload_id})


def remove_file(usage: TeamUsage, file_id: str) -> TeamUsage:
    return TeamUsage({k: size for k, size in usage.files.items() if k != file_id}, usage.holds)
