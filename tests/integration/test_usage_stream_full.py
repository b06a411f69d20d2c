"""A full usage stream refuses new messages and keeps every one it holds (``DiscardPolicy.NEW``, shared/usage.py).

Before, both usage streams discarded old: past ``max_bytes`` a publish evicted the oldest message, usage that
metering may not have read yet (lost billing). Now the publish is refused (the edge's outbox keeps the usage and
retries; metering leaves a message it cannot dead-letter unacked), and nothing is evicted.
"""

from __future__ import annotations

import nats
import pytest

from shared.storage_caps import ENV, MIN_STORE_BYTES, store_caps
from shared.usage import ensure_dead_letter_stream, ensure_usage_stream

pytestmark = [pytest.mark.integration]
CHUNK = 256 << 10  # a message's bytes: a few fill the smallest usage caps


@pytest.mark.parametrize("which", ["usage", "dead letters"])
async def test_a_full_usage_stream_refuses_new_messages_and_evicts_none(bus, monkeypatch, which):
    monkeypatch.setenv(ENV, str(MIN_STORE_BYTES))  # the smallest caps: 1.6 MiB of usage, 0.3 MiB of dead letters
    s, caps = bus.subjects, store_caps()
    ensure, stream, subject, cap = ((ensure_usage_stream, s.usage_stream, s.usage, caps.usage) if which == "usage"
                                    else (ensure_dead_letter_stream, s.usage_dead_letter_stream,
                                          s.usage_dead_letters, caps.usage_dead_letters))
    await ensure(bus)
    sent = 0
    with pytest.raises(nats.js.errors.APIError):
        for sent in range(cap // CHUNK + 2):  # more than fits
            await bus.ledger_js.publish(subject, bytes(CHUNK), headers={"Nats-Msg-Id": f"m-{sent}"})
    state = (await bus.ledger_js.stream_info(stream)).state
    assert (state.first_seq, state.messages) == (1, sent)  # the first message is still there: nothing evicted
