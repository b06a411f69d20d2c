"""StreamReceiver.silent_workers: the workers of open streams that heard nothing for longer than a silence."""

from __future__ import annotations

import time
import types

from shared.bus import StreamReceiver


def receiver() -> StreamReceiver:
    bus = types.SimpleNamespace(subjects=types.SimpleNamespace(stream_prefix=lambda edge: f"im.stream.{edge}"))
    return StreamReceiver(bus, "e1")  # type: ignore[arg-type]


def test_only_open_streams_silent_past_the_silence_name_their_worker():
    r = receiver()
    quiet, chatty, ended = r.open("r1", "w-quiet"), r.open("r2", "w-chatty"), r.open("r3", "w-ended")
    now = time.monotonic()
    quiet.heard_at, chatty.heard_at, ended.heard_at = now - 10, now - 1, now - 10
    ended.done = True
    assert r.silent_workers(now, 5.0) == {"w-quiet"}
    assert r.silent_workers(now, 0.5) == {"w-quiet", "w-chatty"}
    r.close("r1")
    assert r.silent_workers(now, 5.0) == set()
