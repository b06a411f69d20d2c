"""A routing policy named on the command line, with its knobs: ``NAME[:key=value[:key=value...]]``.

    round_robin | least_loaded | session          the simulator's own routers (loadtests/lib/fleet_sim.Router)
    kv_aware                                      the live KvAwarePolicy at its defaults
    kv_aware:decode=0.1                           ... with CostWeights(decode=0.1)
    kv_aware:prefill=2:decode=0.5:kv_usage=4      any CostWeights field
    kv_aware:temperature=0.2                      softmax pick instead of min cost
    kv_aware:bind                                 sessions stay on the worker they were last sent to

``fleet_overrides`` turns a spec into FleetConfig fields; a bad name or knob raises ValueError
(argparse reports it).
"""

from __future__ import annotations

import dataclasses

from services.router.policy import KvRoutingConfig
from services.router.scoring import CostWeights

POLICIES = ("round_robin", "least_loaded", "session", "kv_aware")
WEIGHTS = tuple(f.name for f in dataclasses.fields(CostWeights))


def fleet_overrides(spec: str) -> dict:
    """FleetConfig fields for ``spec`` (policy, and for kv_aware its KvRoutingConfig and session binding)."""
    name, *knobs = spec.strip().split(":")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} in {spec!r}: one of {', '.join(POLICIES)}")
    if knobs and name != "kv_aware":
        raise ValueError(f"{name} takes no knobs ({spec!r})")
    if name != "kv_aware":
        return {"policy": name}
    weights: dict[str, float] = {}
    routing: dict[str, float] = {}
    bind = False
    for knob in knobs:
        key, eq, value = knob.partition("=")
        if key == "bind" and not eq:
            bind = True
        elif key in WEIGHTS and eq:
            weights[key] = float(value)
        elif key == "temperature" and eq:
            routing[key] = float(value)
        else:
            raise ValueError(f"unknown kv_aware knob {knob!r} in {spec!r}: bind, temperature=X or "
                             f"{'|'.join(WEIGHTS)}=X")
    config = KvRoutingConfig(weights=CostWeights(**weights), **routing) if weights or routing else None
    return {"policy": "kv_aware", "kv_routing": config, "kv_bind_sessions": bind}
