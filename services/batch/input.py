"""A batch's input file, streamed: validated a slice at a time off the event loop, kept in a local spool file, read
back a line at a time when the line is sent.

    job_input = await load_input(files.chunks(team, file_id), endpoint, spool_dir)  # or the file's errors
    line = await job_input.read(index)      # a BatchLine, read from the spool (a thread), only while it runs
    job_input.custom_ids[index]; job_input.close()

The file's chunks (128 KiB each, from the files object store) are gathered into slices of SLICE_BYTES; each slice
is written to the spool, cut into lines, checked (lines.InputScanner) and given its prefix path
(dispatch.PrefixTrie) in a worker thread, so a 200 MB / 50,000-line input never holds the event loop (the leader
key's renewals run on it) for more than a slice's hand-over. In memory per line: its place in the spool and its
custom id; the prefix paths only until the job is queued (``take_paths``). The spool is unlinked as soon as it is
opened: it goes with its descriptor, so a replica that dies leaves no file behind. A new leader streams each
unfinished job's input again, one job at a time (service.py).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from array import array
from typing import AsyncIterator

from services.batch.dispatch import PrefixTrie, prompt_text
from services.batch.lines import BatchLine, InputScanner, sendable_line
from shared.batch_schema import BatchLineError

SLICE_BYTES = 256 * 1024  # handed to a thread at a time (two chunks of the object store)


class JobInput:
    """A validated input on this replica: where each line lies in the spool, and its custom id."""

    def __init__(self, spool_dir: str = "") -> None:
        fd, path = tempfile.mkstemp(prefix="infermesh-batch-", suffix=".jsonl", dir=spool_dir or None)
        os.unlink(path)  # the file lives as long as the descriptor
        self._fd: int | None = fd
        self.starts, self.ends = array("q"), array("q")
        self.custom_ids: list[str] = []
        self.model = ""
        self._paths: list[tuple[int, ...]] | None = []

    def __len__(self) -> int:
        return len(self.custom_ids)

    def take_paths(self) -> list[tuple[int, ...]]:
        """The lines' prefix paths, once (the dispatcher's order is made of them; then they are not kept)."""
        paths, self._paths = self._paths or [], None
        return paths

    async def read(self, index: int) -> BatchLine:
        return await asyncio.to_thread(self._read, index)

    def _read(self, index: int) -> BatchLine:
        assert self._fd is not None, "the input was closed"
        start = self.starts[index]
        return sendable_line(index, os.pread(self._fd, self.ends[index] - start, start))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _take(self, scanner: InputScanner, trie: PrefixTrie, data: bytes, last: bool) -> None:
        """One slice, in a worker thread: spooled at the scanner's offset (the spool is the file), lines indexed."""
        assert self._fd is not None and self._paths is not None
        os.pwrite(self._fd, data, scanner.num_bytes)
        for line, start, end in scanner.feed(data) + (scanner.finish() if last else []):
            self.starts.append(start)
            self.ends.append(end)
            self.custom_ids.append(line.custom_id)
            self._paths.append(trie.path(prompt_text(line.body)))
        self.model = scanner.model


async def load_input(chunks: AsyncIterator[bytes], endpoint: str,
                     spool_dir: str = "") -> JobInput | list[BatchLineError]:
    """The input of a batch calling ``endpoint``, streamed from ``chunks``: a JobInput, or why the file is refused
    (lines.py's rules; the spool is gone then)."""
    job_input, scanner, trie = JobInput(spool_dir), InputScanner(endpoint), PrefixTrie()
    try:
        pending = bytearray()
        async for chunk in chunks:
            pending += chunk
            if len(pending) >= SLICE_BYTES:
                await asyncio.to_thread(job_input._take, scanner, trie, bytes(pending), False)
                pending.clear()
        await asyncio.to_thread(job_input._take, scanner, trie, bytes(pending), True)
    except BaseException:
        job_input.close()
        raise
    errors = scanner.errors()
    if errors:
        job_input.close()
        return errors
    return job_input
