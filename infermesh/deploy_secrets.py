"""The secrets of a deployed mesh (docker-compose, Kubernetes): made once, each container shown only its own.

    python -m infermesh.deploy_secrets init /secrets          # once per volume: passwords, keys, nats.json
    python -m infermesh.deploy_secrets provision /run/infermesh   # as admin: every bucket and stream, first
    python -m infermesh.deploy_secrets run /run/infermesh -- python -m services.edge ...   # env from files, exec
    python -m infermesh.deploy_secrets k8s ~/.infermesh-k8s | kubectl apply -f -   # deploy/k8s's Secrets

``init`` writes (0600 files in 0700 folders, except where a container's own user must read them):

| folder            | what                                                   | mounted into (volume subpath)   |
|-------------------|--------------------------------------------------------|---------------------------------|
| ``nats/``         | ``nats.json``: the server config, its three accounts   | nats                            |
|                   | (MESH, STORE, LEDGER: ``infermesh/bus_roles.py``), a   |                                 |
|                   | user per role in each (LEDGER: the usage streams'      |                                 |
|                   | users only)                                            |                                 |
| ``postgres/``     | ``password`` (0644: the postgres image reads it as its | postgres                        |
|                   | own user)                                              |                                 |
| ``<service>/``    | one file per environment variable the service gets:    | that service                    |
|                   | ``INFERMESH_NATS_USER`` / ``_STORE_USER`` /            |                                 |
|                   | ``_LEDGER_USER`` (edge, metering, admission, admin) /  |                                 |
|                   | ``_PASSWORD`` (its role),                              |                                 |
|                   | the ledger's ``INFERMESH_DATABASE_URL`` (metering,     |                                 |
|                   | batch), ``INFERMESH_DEV_KEY`` and                      |                                 |
|                   | ``INFERMESH_EDGE_SECRET`` (edge)                       |                                 |

The API key is ``INFERMESH_API_KEY`` from the host when given (``INFERMESH_API_KEY=... docker compose up``), else
random; it is printed once, when it is made (``docker compose logs secrets`` shows it), never again. A second
``init`` on the same volume keeps every secret (the ledger's password must match the database made with it).
``run`` reads a folder's files into the environment (a file's name is its variable) and replaces itself with the
service, so a secret is never on a command line nor in the compose file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets as random
import sys
from pathlib import Path

from infermesh.bus_auth import load_or_create_secrets, provision, server_config
from infermesh.bus_roles import LEDGER_ROLES, Role, ledger_user, store_user
from infermesh.private_files import write_private
from shared.nats_auth import NatsCredentials
from shared.subjects import Subjects

SERVICES: dict[str, Role] = {"router": Role.ROUTER, "breaker": Role.BREAKER, "admission": Role.ADMISSION,
                             "metering": Role.METERING, "batch": Role.BATCH, "worker": Role.WORKER,
                             "edge": Role.EDGE, "provision": Role.ADMIN}
LEDGER_USERS = ("metering", "batch")  # the services that write the ledger
API_KEY_FILE = "api-key"
NATS_MONITOR_PORT = 8222  # /healthz for the compose health check


def _read_or_make(path: Path, make: str = "", mode: int = 0o600) -> tuple[str, bool]:
    """The secret in ``path``, or ``make`` (default: random) written there; and whether it was made now."""
    if path.exists():
        return path.read_text().strip(), False
    value = make or random.token_urlsafe(32)
    write_private(path, value)
    path.chmod(mode)
    return value, True


def init(folder: Path, namespace: str = "im", nats_listen: str = "0.0.0.0:4222", store_dir: str = "/data",
         database: str = "postgres:5432/infermesh", api_key: str = "",
         monitor_port: int = NATS_MONITOR_PORT) -> str | None:
    """Make what is missing under ``folder``; returns the API key if it was made now (else None)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    roles = load_or_create_secrets(folder / "roles")
    host, _, port = nats_listen.rpartition(":")
    config = server_config(int(port), Path(store_dir), Subjects(namespace), roles, host=host)
    config["http_port"] = monitor_port
    write_private(folder / "nats" / "nats.json", json.dumps(config, indent=1))
    (folder / "postgres").mkdir(mode=0o755, exist_ok=True)
    (folder / "postgres").chmod(0o755)
    db_password, _ = _read_or_make(folder / "postgres" / "password", mode=0o644)
    key, made = _read_or_make(folder / API_KEY_FILE, api_key)
    edge_secret, _ = _read_or_make(folder / "edge-secret")
    for service, role in SERVICES.items():
        env = role_env(role, roles)
        if service in LEDGER_USERS:
            env["INFERMESH_DATABASE_URL"] = f"postgresql://postgres:{db_password}@{database}"
        if service == "edge":
            env |= {"INFERMESH_DEV_KEY": key, "INFERMESH_EDGE_SECRET": edge_secret}
        for name, value in env.items():
            write_private(folder / service / name, value)
    return key if made else None


def role_env(role: Role, roles: dict[Role, str]) -> dict[str, str]:
    """A service's NATS variables: its role's user in MESH, its user in STORE (and in LEDGER for the roles that
    use the usage streams), their password."""
    ledger = {"INFERMESH_NATS_LEDGER_USER": ledger_user(role.value)} if role in LEDGER_ROLES else {}
    return {"INFERMESH_NATS_USER": role.value, "INFERMESH_NATS_STORE_USER": store_user(role.value), **ledger,
            "INFERMESH_NATS_PASSWORD": roles[role]}


def env_of(folder: Path) -> dict[str, str]:
    """Each file of ``folder`` as an environment variable of its name (INFERMESH_ ones only)."""
    return {path.name: path.read_text() for path in sorted(folder.iterdir())
            if path.is_file() and path.name.startswith("INFERMESH_")}


def k8s_secrets(folder: Path, namespace: str = "im", api_key: str = "") -> tuple[str, str | None]:
    """Kubernetes Secrets for deploy/k8s, from the secrets under ``folder`` (made there once, kept): the NATS
    servers' accounts and users (``infermesh-nats-auth``, key ``auth.conf``, included by their config) and one
    Secret per service, ``infermesh-<service>``, whose keys are its environment variables. The ledger's URL is not here:
    Postgres is external (Secret ``infermesh-ledger``, key ``database-url``, made by the operator).
    Returns the manifests (YAML) and the API key if it was made now."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    roles = load_or_create_secrets(folder / "roles")
    key, made = _read_or_make(folder / API_KEY_FILE, api_key)
    edge_secret, _ = _read_or_make(folder / "edge-secret")
    accounts = server_config(4222, Path("/data"), Subjects(namespace), roles)["accounts"]
    documents = [_secret("infermesh-nats-auth", {"auth.conf": f"accounts: {json.dumps(accounts)}\n"})]
    for service, role in SERVICES.items():
        env = role_env(role, roles)
        if service == "edge":
            env |= {"INFERMESH_DEV_KEY": key, "INFERMESH_EDGE_SECRET": edge_secret}
        documents.append(_secret(f"infermesh-{service}", env))
    return yaml.safe_dump_all(documents, sort_keys=False), key if made else None


def _secret(name: str, data: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "infermesh"}}, "stringData": data}


def run(folder: Path, command: list[str]) -> None:
    """Replace this process with ``command``, ``folder``'s variables added to its environment."""
    if not command:
        raise SystemExit("run: no command after --")
    os.execvpe(command[0], command, {**os.environ, **env_of(folder)})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    made = sub.add_parser("init", help="make the secrets a compose mesh lacks")
    made.add_argument("folder", type=Path)
    made.add_argument("--namespace", default=os.environ.get("INFERMESH_NAMESPACE", "im"))
    made.add_argument("--nats-listen", default="0.0.0.0:4222")
    made.add_argument("--store-dir", default="/data", help="JetStream's store, in the nats container")
    made.add_argument("--database", default="postgres:5432/infermesh", help="host:port/database of the ledger")
    made.add_argument("--monitor-port", type=int, default=NATS_MONITOR_PORT, help="nats-server's /healthz port")
    k8s = sub.add_parser("k8s", help="print the Kubernetes Secrets of deploy/k8s (kubectl apply -f -)")
    k8s.add_argument("folder", type=Path, help="where the secrets are kept (made once, reused)")
    k8s.add_argument("--namespace", default=os.environ.get("INFERMESH_NAMESPACE", "im"))
    for name in ("provision", "run"):
        one = sub.add_parser(name)
        one.add_argument("folder", type=Path)
        one.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.what == "init":
        key = init(args.folder, args.namespace, args.nats_listen, args.store_dir, args.database,
                   os.environ.get("INFERMESH_API_KEY", ""), args.monitor_port)
        print(f"infermesh: your API key (shown once; team 'default'): {key}" if key else
              "infermesh: secrets kept from the first start (the API key is in the secrets volume, api-key)",
              flush=True)
    elif args.what == "k8s":
        manifests, key = k8s_secrets(args.folder, args.namespace, os.environ.get("INFERMESH_API_KEY", ""))
        sys.stdout.write(manifests)
        if key:
            print(f"infermesh: your API key (shown once; team 'default'): {key}", file=sys.stderr)
    elif args.what == "provision":
        env = env_of(args.folder)
        asyncio.run(provision(os.environ.get("INFERMESH_NATS_URL", "nats://nats:4222"),
                              os.environ.get("INFERMESH_NAMESPACE", "im"), NatsCredentials.from_env(env)))
        print("infermesh: buckets and streams provisioned", flush=True)
    else:
        run(args.folder, args.command[1:] if args.command[:1] == ["--"] else args.command)


if __name__ == "__main__":
    main(sys.argv[1:])
