"""Each team's file usage (its quota's record) and file index, kept in the files object store's own stream.

    ledger = TeamLedger(bus, bucket, scan=store.all_files)
    usage = await ledger.update("research", lambda u: reserve(u, quota, upload_id, n, time.time()))   # CAS
    await ledger.index("research", file); await ledger.unindex("research", file_id)
    files = await ledger.listed("research")              # reads the team's index entries only

| subject (stream ``OBJ_<bucket>``)      | holds                                                              |
|----------------------------------------|--------------------------------------------------------------------|
| ``$O.<bucket>.C.usage.<team>``         | the team's TeamUsage (shared/file_quota.py), JSON, rolled up;      |
|                                        | written by compare-and-set (expected last subject sequence)        |
| ``$O.<bucket>.C.index.<team>.<id>``    | a stored file's FileObject (JSON); purged when the file is deleted |

They live under the bucket's chunk subjects, which nats' own object store reads only by a chunk's nuid (``nats
object ls/get`` ignore them); in the stream, they count in its ``max_bytes``. A bucket made before them (its
stream's metadata lacks ``LAYOUT_METADATA``) gets a team's record and index built from every file's info the first
time the team is seen. Team names are subject tokens already (``[a-zA-Z0-9_-]``: services/metering/keys.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Awaitable, Callable

import msgspec
from nats.js.api import DeliverPolicy
from nats.js.errors import APIError, NotFoundError
from nats.js.kv import MSG_ROLLUP_SUBJECT

from shared.bus import Bus
from shared.file_quota import TeamUsage
from shared.telemetry import traced

if TYPE_CHECKING:
    from shared.files import FileObject

log = logging.getLogger("infermesh.files")
LAYOUT_METADATA = {"infermesh.files.layout": "2"}  # the stream was made with usage records and an index
WRONG_LAST_SEQUENCE = 10071  # JetStream: the expected last subject sequence did not match
CAS_TRIES = 64  # a team's concurrent uploads race for its record; each try reads the winner's
LIST_TIMEOUT_S = 10.0
Scan = Callable[[], Awaitable[list[tuple[str, "FileObject"]]]]


class TeamLedger:
    def __init__(self, bus: Bus, bucket: str, scan: Scan) -> None:
        self.bus, self.bucket, self.stream = bus, bucket, f"OBJ_{bucket}"
        self._scan = scan  # (team, file) of every live file: the old layout's only listing
        self._indexed_bucket: bool | None = None  # its stream's metadata has LAYOUT_METADATA (read once)

    def _usage_subject(self, team: str) -> str:
        return f"$O.{self.bucket}.C.usage.{team}"

    def _index_subject(self, team: str, file_id: str) -> str:
        return f"$O.{self.bucket}.C.index.{team}.{file_id}"

    # ------------------------------------------------------------ usage
    async def usage(self, team: str) -> TeamUsage:
        return (await self._load(team))[0]

    async def update(self, team: str, change: Callable[[TeamUsage], TeamUsage]) -> TeamUsage:
        """Apply ``change`` to the team's record by compare-and-set, again on the winner's record if another
        writer moved it first; what ``change`` raises (QuotaExceeded) goes to the caller, nothing written."""
        for _ in range(CAS_TRIES):
            usage, revision = await self._load(team)
            changed = change(usage)
            try:
                await self._write(team, changed, revision)
                return changed
            except APIError as exc:
                if exc.err_code != WRONG_LAST_SEQUENCE:
                    raise
        raise RuntimeError(f"the file usage of team {team} kept moving ({CAS_TRIES} tries)")

    async def _write(self, team: str, usage: TeamUsage, revision: int) -> int:
        headers = traced({"Nats-Rollup": MSG_ROLLUP_SUBJECT, "Nats-Expected-Last-Subject-Sequence": str(revision)})
        return (await self.bus.js.publish(self._usage_subject(team), msgspec.json.encode(usage), headers=headers)).seq

    async def _load(self, team: str) -> tuple[TeamUsage, int]:
        """(record, its revision); a team never seen has an empty one (revision 0), built from its files if the
        bucket predates the index."""
        try:
            msg = await self.bus.js.get_last_msg(self.stream, self._usage_subject(team), direct=True)
            return msgspec.json.decode(msg.data or b"{}", type=TeamUsage), msg.seq or 0
        except NotFoundError:
            pass
        if await self._has_layout():
            return TeamUsage(), 0
        migrated = await self._migrate(team)
        try:
            return migrated, await self._write(team, migrated, 0)
        except APIError as exc:
            if exc.err_code != WRONG_LAST_SEQUENCE:
                raise
            return await self._load(team)  # another edge wrote it first

    async def _has_layout(self) -> bool:
        if self._indexed_bucket is None:
            metadata = (await self.bus.js.stream_info(self.stream)).config.metadata or {}
            self._indexed_bucket = LAYOUT_METADATA.items() <= metadata.items()
        return self._indexed_bucket

    async def _migrate(self, team: str) -> TeamUsage:
        """The team's files of an old bucket, indexed, as its first record (the caller's CAS writes it)."""
        files = [file for owner, file in await self._scan() if owner == team]
        for file in files:
            await self.index(team, file)
        log.info("files of team %s: %d indexed from the old layout", team, len(files))
        return TeamUsage({file.id: file.bytes for file in files})

    # ------------------------------------------------------------ index
    async def index(self, team: str, file: "FileObject") -> None:
        await self.bus.js.publish(self._index_subject(team, file.id), msgspec.json.encode(file),
                                  headers=traced({"Nats-Rollup": MSG_ROLLUP_SUBJECT}))

    async def unindex(self, team: str, file_id: str) -> None:
        await self.bus.js.purge_stream(self.stream, subject=self._index_subject(team, file_id))

    async def listed(self, team: str) -> list["FileObject"]:
        """The team's files from its index: one ordered consumer over its entries, no other team's read."""
        from shared.files import FileObject

        await self._load(team)  # an old bucket's team: indexed first
        entries = self._index_subject(team, "*")
        try:
            await self.bus.js.get_last_msg(self.stream, entries)
        except NotFoundError:
            return []
        sub = await self.bus.js.subscribe(entries, stream=self.stream, ordered_consumer=True,
                                          deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
        found: list[FileObject] = []
        try:
            while True:
                msg = await sub.next_msg(timeout=LIST_TIMEOUT_S)
                found.append(msgspec.json.decode(msg.data, type=FileObject))
                if msg.metadata.num_pending == 0:
                    return found
        finally:
            await sub.unsubscribe()
