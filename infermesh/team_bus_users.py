"""A team's own NATS user on the bus ``up`` locked: made on demand, added to the running server without a restart.

    password = add_team_user(data_dir(), "research")   # made once (0600 file); asked again, the same
    reload_team_users(data_dir())                       # the running locked server now knows team-research
    credentials = team_credentials("research")           # what infermesh.batch_client connects with

``up`` writes every team's two users into the server config it starts (``server_users``): ``team-<team>`` in
MESH (its reads, asked of the batch service) and ``team-<team>@store`` in STORE (its submissions), one password;
it records where that config and the server's pid file are (``nats-running.json`` beside the secrets);
``reload_team_users`` rewrites the config's team users and sends the server SIGHUP, which nats-server answers by
reloading its users. A server that is not ``up``'s (a cluster, Kubernetes) takes the entries ``server_users``
gives for each of those two accounts.

Invariants: passwords live only in the 0600 secrets file and the 0600 server config, never on a command line;
a team user's permissions are ``bus_roles.team_permissions`` (its own submissions and jobs, nothing else); the
service roles' users are never touched by a reload.
"""

from __future__ import annotations

import json
import os
import secrets as random
import signal
from pathlib import Path
from typing import Mapping

from infermesh.bus_roles import TEAM_USER_PREFIX, Account, store_user, team_permissions, team_user
from infermesh.private_files import data_dir, write_private
from shared.nats_auth import NatsCredentials
from shared.subjects import Subjects

TEAM_SECRETS_FILE = "nats-team-credentials.json"
TEAM_ACCOUNTS = (Account.MESH, Account.STORE)  # where a team has a user
RUNNING_FILE = "nats-running.json"  # the locked server up runs: its config, pid file, namespace and URL
SECRET_BYTES = 32


def load_team_secrets(folder: Path) -> dict[str, str]:
    path = folder / TEAM_SECRETS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def add_team_user(folder: Path, team: str) -> str:
    """The team's bus password: the stored one, else a new one (stored)."""
    stored = load_team_secrets(folder)
    if team not in stored:
        stored[team] = random.token_urlsafe(SECRET_BYTES)
        write_private(folder / TEAM_SECRETS_FILE, json.dumps(stored, indent=1))
    return stored[team]


def team_credentials(team: str, folder: Path | None = None, tls_ca: str = "") -> NatsCredentials:
    password = load_team_secrets(folder or data_dir()).get(team)
    if password is None:
        raise KeyError(f"team {team!r} has no bus user: infermesh teams bus-user {team}")
    return NatsCredentials(team_user(team), password, tls_ca=tls_ca, store_user=store_user(team_user(team)))


def server_users(subjects: Subjects, team_secrets: Mapping[str, str], account: Account) -> list[dict[str, object]]:
    """The nats-server user entries of these teams in ``account`` (MESH or STORE: ``TEAM_ACCOUNTS``)."""
    if account not in TEAM_ACCOUNTS:
        return []
    return [{"user": team_user(team) if account is Account.MESH else store_user(team_user(team)),
             "password": password, "permissions": team_permissions(team, subjects, account).server_block()}
            for team, password in sorted(team_secrets.items())]


def record_running(folder: Path, config_path: Path, pid_file: Path, namespace: str, url: str) -> None:
    write_private(folder / RUNNING_FILE, json.dumps({"config": str(config_path), "pid_file": str(pid_file),
                                                     "namespace": namespace, "url": url}))


def running_url(folder: Path) -> str | None:
    path = folder / RUNNING_FILE
    return json.loads(path.read_text())["url"] if path.exists() else None


def reload_team_users(folder: Path) -> bool:
    """Rewrite the running locked server's team users and have it reload; False when no such server runs here."""
    path = folder / RUNNING_FILE
    if not path.exists():
        return False
    running = json.loads(path.read_text())
    config_path, pid_file = Path(running["config"]), Path(running["pid_file"])
    if not config_path.exists() or not pid_file.exists():
        return False
    config = json.loads(config_path.read_text())
    subjects, team_secrets = Subjects(running["namespace"]), load_team_secrets(folder)
    for account in TEAM_ACCOUNTS:
        entry = config["accounts"][account.value]
        users = [u for u in entry["users"] if not str(u["user"]).startswith(TEAM_USER_PREFIX)]
        entry["users"] = users + server_users(subjects, team_secrets, account)
    write_private(config_path, json.dumps(config, indent=1))
    pid = _nats_server_pid(pid_file)
    if pid is None:
        return False  # the server that wrote it is gone (up stopped): the next up reads the users anyway
    os.kill(pid, signal.SIGHUP)  # nats-server reloads its config on SIGHUP
    return True


def _nats_server_pid(pid_file: Path) -> int | None:
    """The pid in ``pid_file`` if a nats-server has it now (never signal a process that reused a stale pid)."""
    try:
        pid = int(pid_file.read_text().strip())
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if b"nats-server" in command else None
