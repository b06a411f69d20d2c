"""How big a message on the bus may be, in one place.

NATS refuses a message over its server's ``max_payload`` (1 MiB by default). A generate request carries its whole
prompt (packed, 2-3 bytes a token: ``shared/token_pack.py``), so the servers infermesh configures (``infermesh up``,
docker-compose, Kubernetes, a supercluster) allow ``MAX_PAYLOAD_BYTES``, and the edge answers a prompt that would
not fit the server it is connected to with a 400 (``prompt_too_large``) before it takes a lease.
"""

from __future__ import annotations

from shared import token_pack

# 8 MiB (NATS advises no more): a generate request of up to ~2.7M tokens; NATS' default 1 MiB carries ~330K
MAX_PAYLOAD_BYTES = 8 << 20
# what a generate request holds besides its token ids and sampling: ids, its billing context and signature, trace
# headers, a KV handle (the largest, a prefill worker's block ids: ~8 bytes per block)
ENVELOPE_BYTES = 16 << 10


def generate_request_bytes(num_ids: int, max_id: int, sampling_bytes: int) -> int:
    """An upper bound of a generate request's size on the bus: the edge checks it against ``max_payload``."""
    return token_pack.packed_size(num_ids, max_id) + sampling_bytes + ENVELOPE_BYTES
