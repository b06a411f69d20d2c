"""The usage dead-letter stream: where a usage message metering can never write goes, instead of
blocking the messages behind it (``<ns>_usage_dlq``, ``DeadLetter``; see shared/usage.py).

    sink = DeadLetters(bus); await sink.start()
    if await sink.put(msg, "invalid", error):   # kept on the stream: the usage message is acked
        ...

A usage message is acked only once its dead letter is on the stream; if that publish fails (NATS
away), it stays unacked and comes back after ``ack_wait_s`` to be judged again. Its ``Nats-Msg-Id``
is its usage stream sequence, so a message dead-lettered twice is kept once.
"""

from __future__ import annotations

import logging
import time

from nats.aio.msg import Msg

from shared import schema
from shared.bus import Bus
from shared.schema import DeadLetter, DeadLetterReason
from shared.telemetry import traced
from shared.usage import dead_letter_id, ensure_dead_letter_stream

log = logging.getLogger("infermesh.metering")
MAX_ERROR_CHARS = 2000
PUBLISH_TIMEOUT_S = 2.0


def dead_letter(msg: Msg, reason: DeadLetterReason, error: BaseException, now: float) -> DeadLetter:
    """The dead letter of ``msg``: its data and headers as they came, and why it can never be written."""
    text = f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS]
    return DeadLetter(reason=reason, error=text, stream_seq=msg.metadata.sequence.stream, subject=msg.subject,
                      data=msg.data, headers=dict(msg.headers or {}), ts=now)


class DeadLetters:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def start(self) -> None:
        await ensure_dead_letter_stream(self.bus)

    async def put(self, msg: Msg, reason: DeadLetterReason, error: BaseException) -> bool:
        """Dead-letter ``msg`` and ack it; False (nothing acked) when the dead letter could not be published."""
        letter = dead_letter(msg, reason, error, time.time())
        log.error("usage message (seq %d) dead-lettered as %s: %s", letter.stream_seq, reason, letter.error)
        try:
            await self.bus.ledger_js.publish(self.bus.subjects.usage_dead_letters, schema.encode(letter),
                                      headers=traced({"Nats-Msg-Id": dead_letter_id(letter.stream_seq)}),
                                      timeout=PUBLISH_TIMEOUT_S)
        except Exception as exc:
            log.warning("cannot dead-letter usage message (seq %d): %s; it will come back", letter.stream_seq, exc)
            return False
        try:
            await msg.ack()
        except Exception as exc:  # it comes back, and its second dead letter is deduplicated
            log.warning("cannot ack dead-lettered usage message (seq %d): %s", letter.stream_seq, exc)
        return True
