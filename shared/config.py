"""Service configuration: one dataclass per service, filled from defaults < env vars < flags.

A field ``heartbeat_s`` of a config is read from ``INFERMESH_HEARTBEAT_S`` and from
``--heartbeat-s``. Field types (str, int, float, bool, and ``X | None``) drive parsing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, Mapping, Sequence, TypeVar

from shared.nats_auth import INHERITED, NatsCredentials

ENV_PREFIX = "INFERMESH_"

C = TypeVar("C")


@dataclasses.dataclass(slots=True)
class BusConfig:
    """Fields every service has."""

    nats_url: str = "nats://127.0.0.1:4222"
    namespace: str = "im"
    log_level: str = "INFO"
    # NATS credentials and TLS (shared/nats_auth.py); pass secrets as INFERMESH_NATS_* env vars, not flags
    nats_user: str = ""
    nats_password: str = dataclasses.field(default="", repr=False)
    nats_creds: str = ""
    nats_tls_ca: str = ""
    nats_tls_cert: str = ""
    nats_tls_key: str = ""
    nats_store_user: str = ""  # the role's user in the STORE account (JetStream); empty: one account (open server)
    nats_ledger_user: str = ""  # its user in the LEDGER account (the usage streams); empty: STORE's connection
    # Prometheus /metrics and /health on a port of their own (shared/metrics.py): -1 none, 0 any free port. Not
    # on the API's port: the GenAI histograms carry team labels
    metrics_port: int = -1
    metrics_host: str = "127.0.0.1"

    def credentials(self) -> NatsCredentials:
        """What this process inherited through its pipe (``infermesh up``), else these fields (env vars, flags)."""
        if INHERITED is not None:
            return INHERITED
        return NatsCredentials(self.nats_user, self.nats_password, self.nats_creds, self.nats_tls_ca,
                               self.nats_tls_cert, self.nats_tls_key, self.nats_store_user, self.nats_ledger_user)


def _base_type(annotation: Any) -> type:
    """int | None -> int; bool -> bool."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _convert(kind: type, text: str) -> Any:
    return _parse_bool(text) if kind is bool else kind(text)


def load_config(
    cls: type[C],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    description: str | None = None,
) -> C:
    """Build ``cls`` from its defaults, then ``INFERMESH_*`` env vars, then ``argv`` flags."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    parser = argparse.ArgumentParser(description=description or cls.__doc__)
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = _base_type(hints[field.name])
        env_name = ENV_PREFIX + field.name.upper()
        if env_name in env:
            try:
                values[field.name] = _convert(kind, env[env_name])
            except ValueError as exc:
                raise SystemExit(f"{env_name}: {exc}") from exc
        flag = "--" + field.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, dest=field.name, type=kind, default=None, metavar=kind.__name__.upper())
    args = parser.parse_args(list(argv) if argv is not None else [])
    values.update({k: v for k, v in vars(args).items() if v is not None})
    return cls(**values)
