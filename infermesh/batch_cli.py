"""``infermesh batch``: a team's batch jobs through the edge's OpenAI Batch API, with the official SDK.

    infermesh batch submit FILE [--model M] [--endpoint E] [--metadata K=V]... [--wait]
    infermesh batch list [--limit N]
    infermesh batch status ID
    infermesh batch cancel ID
    infermesh batch results ID [--errors] [-o OUT]

Every command takes ``--base-url`` (default: $INFERMESH_BASE_URL, else http://127.0.0.1:8000/v1) and
``--api-key`` (default: $INFERMESH_API_KEY): what a user with a key has. ``submit`` uploads FILE (an OpenAI
batch input file, JSONL) with ``purpose=batch``, creates the batch and prints its id on stdout; ``--model``
fills ``body.model`` in the lines that lack one; ``--endpoint`` defaults to the first line's ``url``. With
``--wait`` it follows the batch, a progress line on stderr (lines done and failed of the total, tokens when
the API reports them, an ETA from the rate seen so far), re-read every ``--poll-s`` seconds (the HTTP API has
no push; a program on the bus follows the job's events instead: ``infermesh/batch_client.py``), and ends with
the final status and file ids; exit 0 only if the batch completed. ``results`` writes the output file (or
with ``--errors`` the error file) to stdout or ``-o``, once the batch has ended. An API error: one line on
stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from openai import OpenAI
    from openai.types import Batch

COMMANDS = ("batch",)
DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
DEFAULT_ENDPOINT = "/v1/chat/completions"
TERMINAL = ("completed", "failed", "expired", "cancelled")


class _Failed(Exception):
    """A command that cannot go on: its message is the one line the user sees."""


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register ``batch`` and its actions on the ``infermesh`` parser's subcommands."""
    api = argparse.ArgumentParser(add_help=False)
    api.add_argument("--base-url", default=os.environ.get("INFERMESH_BASE_URL") or DEFAULT_BASE_URL,
                     help=f"the edge's API (default: $INFERMESH_BASE_URL, else {DEFAULT_BASE_URL})")
    api.add_argument("--api-key", default=os.environ.get("INFERMESH_API_KEY", ""),
                     help="a team's key (default: $INFERMESH_API_KEY)")
    actions = commands.add_parser("batch", help="batch jobs (the OpenAI Batch API on the edge)").add_subparsers(
        dest="action", required=True)

    submit = actions.add_parser("submit", parents=[api], help="upload a JSONL file and run it as a batch")
    submit.add_argument("file", type=Path)
    submit.add_argument("--model", default="", help="fill body.model of the lines that lack it")
    submit.add_argument("--endpoint", default="", help=f"default: the first line's url, else {DEFAULT_ENDPOINT}")
    submit.add_argument("--metadata", action="append", default=[], metavar="K=V", help="a metadata pair (repeat)")
    submit.add_argument("--wait", action="store_true", help="follow it to its end, progress on stderr")
    submit.add_argument("--poll-s", type=float, default=1.0, help="with --wait: seconds between reads")

    listing = actions.add_parser("list", parents=[api], help="the team's batches, newest first")
    listing.add_argument("--limit", type=int, default=20)
    actions.add_parser("status", parents=[api], help="a batch as JSON").add_argument("id")
    actions.add_parser("cancel", parents=[api], help="cancel a batch (finished lines are kept)").add_argument("id")
    results = actions.add_parser("results", parents=[api], help="write a finished batch's output JSONL")
    results.add_argument("id")
    results.add_argument("--errors", action="store_true", help="the error file instead")
    results.add_argument("-o", "--output", type=Path, default=None, help="write here (default: stdout)")


def run(args: argparse.Namespace) -> int:
    import openai

    try:
        if not args.api_key:
            raise _Failed("no API key: pass --api-key or set INFERMESH_API_KEY")
        client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=2)
        return ACTIONS[args.action](client, args)
    except _Failed as exc:
        print(f"infermesh batch {args.action}: {exc}", file=sys.stderr)
    except openai.APIStatusError as exc:
        message = exc.body.get("message") if isinstance(exc.body, dict) else None
        print(f"infermesh batch {args.action}: {exc.status_code}: {message or exc.message}", file=sys.stderr)
    except openai.APIConnectionError as exc:
        print(f"infermesh batch {args.action}: cannot reach {args.base_url}: {exc}", file=sys.stderr)
    return 1


# ---------------------------------------------------------------- submit
def with_model(data: bytes, model: str) -> bytes:
    """The file with ``body.model`` set where a line lacks it; every other line as it was (the service judges)."""
    out = []
    for raw in data.splitlines(keepends=True):
        try:
            line = json.loads(raw) if raw.strip() else None
        except ValueError:
            line = None
        if isinstance(line, dict) and isinstance(line.get("body"), dict) and not line["body"].get("model"):
            line["body"]["model"] = model
            raw = json.dumps(line).encode() + b"\n"
        out.append(raw)
    return b"".join(out)


def endpoint_of(data: bytes) -> str:
    for raw in data.splitlines():
        if raw.strip():
            try:
                url = json.loads(raw).get("url")
            except (ValueError, AttributeError):
                return DEFAULT_ENDPOINT
            return url if isinstance(url, str) else DEFAULT_ENDPOINT
    return DEFAULT_ENDPOINT


def _metadata(pairs: list[str]) -> dict[str, str] | None:
    if any("=" not in pair for pair in pairs):
        raise _Failed("--metadata takes KEY=VALUE")
    return dict(pair.split("=", 1) for pair in pairs) or None


def _submit(client: OpenAI, args: argparse.Namespace) -> int:
    try:
        data = args.file.read_bytes()
    except OSError as exc:
        raise _Failed(f"cannot read {args.file}: {exc.strerror}") from None
    if args.model:
        data = with_model(data, args.model)
    upload = client.files.create(file=(args.file.name, data), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=args.endpoint or endpoint_of(data),
                                  completion_window="24h", metadata=_metadata(args.metadata))
    print(batch.id, flush=True)
    if not args.wait:
        return 0
    try:
        batch = wait(client, batch, args.poll_s, sys.stderr)
    except KeyboardInterrupt:  # the batch runs on without us
        print(f"\n{batch.id} runs on: infermesh batch status {batch.id}", file=sys.stderr)
        return 130
    return 0 if batch.status == "completed" else 1


# ---------------------------------------------------------------- --wait
class Progress:
    """The rate lines end at, from the counts seen so far (local clock: the server's may differ)."""

    def __init__(self) -> None:
        self.first: tuple[float, int] | None = None  # (when, lines ended) at the first in_progress read

    def eta_s(self, ended: int, total: int, now: float) -> float | None:
        if self.first is None:
            self.first = (now, ended)
            return None
        since, ended_then = self.first
        if ended <= ended_then or now <= since:
            return None
        return (total - ended) / ((ended - ended_then) / (now - since))


def progress_line(batch: Batch, eta_s: float | None) -> str:
    """``batch_1 in_progress: 3/10 done, 1 failed, 420 tokens, ETA 7s``."""
    counts = batch.request_counts
    parts = [f"{batch.id} {batch.status}"]
    if counts is not None and counts.total:
        parts.append(f": {counts.completed}/{counts.total} done, {counts.failed} failed")
    usage = getattr(batch, "usage", None)
    if usage is not None and getattr(usage, "total_tokens", None):
        parts.append(f", {usage.total_tokens} tokens")
    if eta_s is not None and batch.status not in TERMINAL:
        parts.append(f", ETA {eta_s:.0f}s")
    return "".join(parts)


def final_line(batch: Batch) -> str:
    line = f"{progress_line(batch, None)}; output {batch.output_file_id or '-'}, errors {batch.error_file_id or '-'}"
    for error in (batch.errors.data if batch.errors and batch.errors.data else []):
        where = f" (line {error.line})" if error.line else ""
        line += f"\n  {error.code}{where}: {error.message}"
    return line


def wait(client: OpenAI, batch: Batch, poll_s: float, out: TextIO) -> Batch:
    """Follow the batch to its end, one progress line on ``out`` (rewritten in place on a terminal)."""
    progress, shown, tty = Progress(), "", out.isatty()
    while batch.status not in TERMINAL:
        counts = batch.request_counts
        eta = (progress.eta_s(counts.completed + counts.failed, counts.total, time.monotonic())
               if batch.status == "in_progress" and counts is not None and counts.total else None)
        line = progress_line(batch, eta)
        if line != shown:
            out.write(f"\r\x1b[K{line}" if tty else f"{line}\n")
            out.flush()
            shown = line
        time.sleep(poll_s)
        batch = client.batches.retrieve(batch.id)
    out.write(f"\r\x1b[K{final_line(batch)}\n" if tty else f"{final_line(batch)}\n")
    out.flush()
    return batch


# ---------------------------------------------------------------- the rest
def _list(client: OpenAI, args: argparse.Namespace) -> int:
    for batch in client.batches.list(limit=args.limit).data:
        counts = batch.request_counts
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(batch.created_at))
        done = f"{counts.completed}/{counts.total} done, {counts.failed} failed" if counts else ""
        print(f"{batch.id}\t{batch.status}\t{created}\t{done}")
    return 0


def _status(client: OpenAI, args: argparse.Namespace) -> int:
    print(client.batches.retrieve(args.id).model_dump_json(indent=2))
    return 0


def _cancel(client: OpenAI, args: argparse.Namespace) -> int:
    batch = client.batches.cancel(args.id)
    print(f"{batch.id} {batch.status}")
    return 0


def _results(client: OpenAI, args: argparse.Namespace) -> int:
    batch = client.batches.retrieve(args.id)
    if batch.status not in TERMINAL:
        raise _Failed(f"{batch.id} is {batch.status}: its files come when it ends")
    file_id = batch.error_file_id if args.errors else batch.output_file_id
    data = client.files.content(file_id).read() if file_id else b""
    if args.output is not None:
        args.output.write_bytes(data)
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    return 0


ACTIONS = {"submit": _submit, "list": _list, "status": _status, "cancel": _cancel, "results": _results}
