"""A locked nats-server for tests: ``infermesh up``'s generated config, one namespace, its log to read back."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from infermesh.bus_auth import (
    TlsFiles,
    load_or_create_secrets,
    nats_url,
    provision,
    role_credentials,
    server_config,
    write_private,
)
from infermesh.bus_roles import Role
from infermesh.processes import nats_server_binary
from infermesh.team_bus_users import add_team_user, load_team_secrets, record_running, team_credentials
from shared.bus import Bus
from shared.nats_auth import NatsCredentials
from shared.ports import free_port
from shared.subjects import Subjects
from tests.utils import wait_for_port

OBSERVER = NatsCredentials("observer", "observer-password")  # tests only: sees JetStream's state, changes nothing
LEDGER_OBSERVER = NatsCredentials("observer@ledger", "observer-password")  # the same, in the LEDGER account
VIOLATION = re.compile(r"(Publish|Subscription) Violation|Permissions Violation|authentication error")


@dataclass
class LockedNats:
    """nats-server with one user per role for ``namespace``, provisioned as ``infermesh up`` does."""

    folder: Path
    namespace: str
    tls: TlsFiles | None = None
    url: str = ""
    secrets: dict[Role, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.folder / "nats.log"

    @property
    def secrets_dir(self) -> Path:
        return self.folder / "secrets"

    def start(self, teams: tuple[str, ...] = (), observer: bool = False) -> "LockedNats":
        """Started with a user for each of ``teams``, and recorded as ``up`` records its server, so
        ``team_bus_users.reload_team_users(self.secrets_dir)`` adds a team to it as it runs. With ``observer``, a
        test-only user beside JetStream (``OBSERVER`` in STORE, ``LEDGER_OBSERVER`` in LEDGER) that may read stream
        and consumer info."""
        self.secrets = load_or_create_secrets(self.secrets_dir)
        for team in teams:
            add_team_user(self.secrets_dir, team)
        port = free_port()
        config = server_config(port, self.folder / "store", Subjects(self.namespace), self.secrets, self.tls,
                               team_secrets=load_team_secrets(self.secrets_dir), pid_file=self.folder / "nats.pid")
        for account, user in (("STORE", OBSERVER), ("LEDGER", LEDGER_OBSERVER)) if observer else ():
            config["accounts"][account]["users"].append({  # type: ignore[index]
                "user": user.user, "password": user.password, "permissions": {
                    "publish": {"allow": ["$JS.API.CONSUMER.INFO.>", "$JS.API.STREAM.INFO.>",
                                          "$JS.API.STREAM.MSG.GET.>"]},
                    "subscribe": {"allow": [f"_INBOX.{user.user}.>"]}}})
        write_private(self.folder / "nats.json", json.dumps(config))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([nats_server_binary(), "-c", str(self.folder / "nats.json")],
                                         stdout=log, stderr=subprocess.STDOUT)
        assert wait_for_port(port, 10), "nats-server did not start"
        self.url = nats_url(port, self.tls)
        record_running(self.secrets_dir, self.folder / "nats.json", self.folder / "nats.pid", self.namespace, self.url)
        return self

    async def provision(self) -> None:
        await provision(self.url, self.namespace, self.credentials(Role.ADMIN))

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)

    def credentials(self, role: Role) -> NatsCredentials:
        return role_credentials(role, self.secrets, self.tls)

    def team_credentials(self, team: str) -> NatsCredentials:
        return team_credentials(team, self.secrets_dir, tls_ca=self.tls.ca if self.tls else "")

    async def bus(self, role: Role, name: str = "") -> Bus:
        return await Bus.connect(self.url, self.namespace, name or f"{role.value}-test", self.credentials(role))

    def violations(self) -> list[str]:
        """The server's log lines about refused publishes, subscriptions and logins, so far."""
        return [line for line in self.log_path.read_text(errors="replace").splitlines() if VIOLATION.search(line)]

    async def wait_for_violation(self, needle: str, timeout_s: float = 5.0) -> str:
        """The first violation line containing ``needle`` (the server logs it as it refuses)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            found = [line for line in self.violations() if needle in line]
            if found:
                return found[0]
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"no violation about {needle!r}; the server logged: {self.violations()}")
            await asyncio.sleep(0.05)


def make_tls(folder: Path) -> TlsFiles:
    """A self-signed CA and a server certificate for 127.0.0.1 / localhost signed by it (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("infermesh test CA")).issuer_name(name("infermesh test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    server = (x509.CertificateBuilder().subject_name(name("localhost")).issuer_name(ca.subject)
              .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
              .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                          x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                             critical=False)
              .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    key_format = (pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (folder / "ca.pem").write_bytes(ca.public_bytes(pem))
    (folder / "server.pem").write_bytes(server.public_bytes(pem))
    (folder / "server-key.pem").write_bytes(server_key.private_bytes(*key_format))
    return TlsFiles(cert=str(folder / "server.pem"), key=str(folder / "server-key.pem"), ca=str(folder / "ca.pem"))
