"""How many copies JetStream keeps of every stream, bucket and object store infermesh makes: one setting.

``INFERMESH_STREAM_REPLICAS`` (default 1) is read here and nowhere else; whoever creates a stream or bucket
(admin's provisioning on a locked bus, a service on an open one) asks ``stream_replicas()``. A deploy sets it
from its NATS cluster's size (``replicas_for_cluster``): R1 on one server, R3 on three or more (a write then
needs two of three servers, so one can be lost with nothing lost). JetStream refuses a stream with more replicas
than the cluster has servers, so a wrong setting fails at provisioning, loudly, not later.

It applies when a stream is created: one that exists keeps its own (services may not update streams on a locked
bus; an operator moves an existing one with ``nats stream edit --replicas``).
"""

from __future__ import annotations

import os
from typing import Mapping

ENV = "INFERMESH_STREAM_REPLICAS"
MAX_REPLICAS = 5  # JetStream's limit


def replicas_for_cluster(servers: int) -> int:
    """R3 where three servers can hold a quorum, else R1 (R2 survives no loss: a write needs both)."""
    if servers < 1:
        raise ValueError(f"a NATS cluster has at least one server, not {servers}")
    return 3 if servers >= 3 else 1


def stream_replicas(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    text = env.get(ENV, "").strip() or "1"
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{ENV} must be a whole number of replicas (1..{MAX_REPLICAS}), not {text!r}") from None
    if not 1 <= value <= MAX_REPLICAS:
        raise ValueError(f"{ENV} must be 1..{MAX_REPLICAS}, not {value}")
    return value
