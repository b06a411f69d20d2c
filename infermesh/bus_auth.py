"""A locked bus for ``infermesh up``: per-role secrets kept across starts, the nats-server config, provisioning.

    secrets = load_or_create_secrets(data_dir())            # {role: password}; made once, 0600, reused
    config = server_config(port, store_dir, Subjects(ns), secrets, tls)   # users with bus_roles' permissions
    write_private(path, json.dumps(config))                  # 0600: it holds the passwords
    await provision(url, ns, role_credentials(Role.ADMIN, secrets, tls))   # buckets, files, streams, first
    url = start_locked_nats(group, state, ns, tls)          # all of it; group hands each service its credentials

Invariants: the secrets file and the server config are written 0600 in folders of 0700 and never printed;
the config has the three accounts of ``infermesh/bus_roles.py`` (MESH: core, no JetStream; STORE: JetStream;
LEDGER: the usage streams);
a service gets its own role's credentials and no other's through a pipe it inherits (``ProcessGroup.spawn``),
never in its environment nor on its command line; every bucket and the usage stream exist before any service
connects, so no service can be the first to create one with a config of its own; without credentials the
server refuses the connection.
"""

from __future__ import annotations

import asyncio
import json
import secrets as random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Mapping

from infermesh.bus_roles import (
    LEDGER_ROLES,
    Account,
    Role,
    account_permissions,
    account_user,
    buckets,
    ledger_user,
    store_user,
)
from infermesh.private_files import data_dir, write_private
from infermesh.processes import ProcessGroup
from infermesh.team_bus_users import load_team_secrets, record_running, server_users
from shared.bus_limits import MAX_PAYLOAD_BYTES
from shared.nats_auth import NatsCredentials
from shared.ports import free_port, wait_for_port
from shared.storage_caps import max_file_store
from shared.subjects import Subjects

SECRETS_FILE = "nats-credentials.json"
SECRET_BYTES = 32


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The server's certificate and key (PEM), and the CA clients check it with ("" = the system's CAs)."""

    cert: str
    key: str
    ca: str = ""


def tls_files(cert: str = "", key: str = "", ca: str = "") -> TlsFiles | None:
    """``up``'s ``--nats-tls-cert/-key/-ca`` as TlsFiles (absolute paths: nats-server runs elsewhere); None: no TLS."""
    if not (cert or key or ca):
        return None
    if not (cert and key):
        raise SystemExit("--nats-tls-cert and --nats-tls-key go together (and --nats-tls-ca with them)")
    return TlsFiles(*(str(Path(f).resolve()) if f else "" for f in (cert, key, ca)))


def load_or_create_secrets(folder: Path) -> dict[Role, str]:
    """Each role's password: read from ``folder/nats-credentials.json``, made (random) for roles it lacks."""
    path = folder / SECRETS_FILE
    stored: dict[str, str] = json.loads(path.read_text()) if path.exists() else {}
    secrets = {role: stored.get(role.value) or random.token_urlsafe(SECRET_BYTES) for role in Role}
    if any(stored.get(role.value) != secret for role, secret in secrets.items()) or path.stat().st_mode & 0o077:
        write_private(path, json.dumps({role.value: secret for role, secret in secrets.items()}, indent=1))
    return secrets


def admin_credentials(folder: Path | None = None) -> NatsCredentials:
    """What an operator's command (the admin CLI, a probe) connects as: the ``INFERMESH_NATS_*`` env vars when
    they name a user or a creds file; else the admin role of the bus ``up`` locked on this machine (its secrets
    file, with the env's TLS files); else anonymous (an open server)."""
    env = NatsCredentials.from_env()
    path = (folder or data_dir()) / SECRETS_FILE
    if env.user or env.creds_file or not path.exists():
        return env
    return replace(role_credentials(Role.ADMIN, {Role.ADMIN: json.loads(path.read_text())[Role.ADMIN.value]}),
                   tls_ca=env.tls_ca, tls_cert=env.tls_cert, tls_key=env.tls_key)


def role_credentials(role: Role, secrets: Mapping[Role, str], tls: TlsFiles | None = None) -> NatsCredentials:
    """The role's users (MESH, STORE, and LEDGER for ``LEDGER_ROLES``) and password."""
    return NatsCredentials(role.value, secrets[role], tls_ca=tls.ca if tls else "", store_user=store_user(role.value),
                           ledger_user=ledger_user(role.value) if role in LEDGER_ROLES else "")


def server_config(port: int, store_dir: Path, subjects: Subjects, secrets: dict[Role, str],
                  tls: TlsFiles | None = None, host: str = "127.0.0.1",
                  team_secrets: Mapping[str, str] | None = None, pid_file: Path | None = None) -> dict[str, object]:
    """A nats-server config (JSON is valid config syntax): JetStream, the two accounts (``server_accounts``: a
    user per role in each, and one per team that has a bus user, infermesh/team_bus_users.py), TLS if given."""
    config: dict[str, object] = {
        "listen": f"{host}:{port}",
        "max_payload": MAX_PAYLOAD_BYTES,  # a long prompt's generate request (shared/bus_limits.py)
        # every stream's max_bytes is reserved inside it (shared/storage_caps.py): nats' default is 75% of the disk
        "jetstream": {"store_dir": str(store_dir), "max_file_store": max_file_store()},
        "accounts": server_accounts(subjects, secrets, team_secrets or {}),
    }
    if pid_file is not None:
        config["pid_file"] = str(pid_file)
    if tls is not None:
        config["tls"] = {"cert_file": tls.cert, "key_file": tls.key, **({"ca_file": tls.ca} if tls.ca else {}),
                         "timeout": 5}
    return config


def server_accounts(subjects: Subjects, secrets: Mapping[Role, str],
                    team_secrets: Mapping[str, str]) -> dict[str, dict[str, object]]:
    """The config's ``accounts``: MESH (no JetStream: core traffic) holds each role's user and each team's;
    STORE (JetStream) each role's ``<role>@store`` user, same password, and each team's; LEDGER (JetStream: the
    usage streams only) the ``<role>@ledger`` user of the roles that use them (infermesh/bus_roles.py)."""
    def users(account: Account, roles: Iterable[Role] = Role) -> list[dict[str, object]]:
        return [{"user": account_user(role, account), "password": secrets[role],
                 "permissions": account_permissions(role, subjects, account).server_block()} for role in roles]

    return {Account.MESH.value: {"users": [*users(Account.MESH), *server_users(subjects, team_secrets, Account.MESH)]},
            Account.STORE.value: {"jetstream": "enabled",
                                  "users": [*users(Account.STORE),
                                            *server_users(subjects, team_secrets, Account.STORE)]},
            Account.LEDGER.value: {"jetstream": "enabled",
                                   "users": users(Account.LEDGER, [r for r in Role if r in LEDGER_ROLES])}}


def nats_url(port: int, tls: TlsFiles | None, host: str = "127.0.0.1") -> str:
    return f"{'tls' if tls else 'nats'}://{host}:{port}"


async def provision(url: str, namespace: str, admin: NatsCredentials) -> None:
    """Create every bucket, object store and stream of the namespace (as the services would), so a service never
    makes one."""
    from services.batch.streams import ensure_batch_streams
    from shared.bus import Bus
    from shared.files import ensure_files_bucket
    from shared.kv_cas import ensure_bucket
    from shared.orphans import ensure_orphans_stream
    from shared.usage import ensure_dead_letter_stream, ensure_usage_stream

    bus = await Bus.connect(url, namespace, "infermesh-provision", admin)
    try:
        for bucket in buckets(bus.subjects):
            await ensure_bucket(bus, bucket)
        for ensure in (ensure_files_bucket, ensure_usage_stream, ensure_dead_letter_stream, ensure_orphans_stream,
                       ensure_batch_streams):
            await ensure(bus)
    finally:
        await bus.close()


def start_locked_nats(group: ProcessGroup, state: Path, namespace: str, tls: TlsFiles | None = None,
                      secrets_dir: Path | None = None) -> str:
    """Start nats-server locked (secrets made once under ``secrets_dir``, default ``data_dir()``), provision it,
    and give ``group`` each service role's credentials; returns the URL."""
    folder = secrets_dir or data_dir()
    secrets = load_or_create_secrets(folder)
    port = free_port()
    config_path, pid_file = state / "nats" / "nats-server.json", state / "nats" / "nats-server.pid"
    config = server_config(port, state / "nats" / "store", Subjects(namespace), secrets, tls,
                           team_secrets=load_team_secrets(folder), pid_file=pid_file)
    write_private(config_path, json.dumps(config, indent=1))
    group.spawn_nats_config(config_path)
    if not wait_for_port(port, 15):
        raise RuntimeError("nats-server did not start")
    url = nats_url(port, tls)
    record_running(folder, config_path, pid_file, namespace, url)  # where `infermesh teams bus-user` adds a team
    asyncio.run(provision(url, namespace, role_credentials(Role.ADMIN, secrets, tls)))
    group.bus_credentials = {role.value: role_credentials(role, secrets, tls) for role in Role}
    return url
