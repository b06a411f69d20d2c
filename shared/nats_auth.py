"""How a process proves who it is to NATS and checks the server: a user and password or a creds file, and TLS.

    credentials = NatsCredentials.from_env()    # INFERMESH_NATS_USER, _PASSWORD, _STORE_USER, _LEDGER_USER, ...
    nc = await nats.connect(url, **credentials.connect_options(url))              # the MESH account: core
    store = await nats.connect(url, **credentials.store().connect_options(url))   # the STORE account: JetStream
    ledger = await nats.connect(url, **credentials.ledger().connect_options(url))  # LEDGER: the usage streams
    child_env = credentials.env()                # the same variables, for a child process (never its argv)
    read_fd, child_env = credentials.pipe_to_child()   # or through a pipe it inherits: no secret in its env

| field          | env var                       | meaning                                                         |
|----------------|-------------------------------|-----------------------------------------------------------------|
| ``user``       | ``INFERMESH_NATS_USER``       | the NATS user (``infermesh up``: the service's role)            |
| ``password``   | ``INFERMESH_NATS_PASSWORD``   | its password (needs ``user``)                                   |
| ``store_user`` | ``INFERMESH_NATS_STORE_USER`` | the role's user in the STORE account (JetStream), same password |
| ``ledger_user``| ``INFERMESH_NATS_LEDGER_USER``| its user in the LEDGER account (the usage streams), same one    |
| ``creds_file`` | ``INFERMESH_NATS_CREDS``      | a ``.creds`` file (JWT + nkey seed) instead of user/password    |
| ``tls_ca``     | ``INFERMESH_NATS_TLS_CA``     | the CA that signed the server's certificate (else the system's) |
| ``tls_cert``   | ``INFERMESH_NATS_TLS_CERT``   | a client certificate, for servers that verify clients           |
| ``tls_key``    | ``INFERMESH_NATS_TLS_KEY``    | its private key (``tls_cert`` and ``tls_key`` go together)      |

A process started with ``INFERMESH_NATS_CREDENTIALS_FD`` set (``infermesh up``'s services) reads its credentials
from that inherited pipe when this module is imported, closes it and drops the variable, so they are in no
environment (``/proc/<pid>/environ`` keeps a process's first one) and no file; they win over the env vars.

Invariants: no credentials means an anonymous connection (an open server, as in the tests); a user's
replies come back on ``_INBOX.<user>.>``, the only inbox a locked server lets that user subscribe to, so
one role never reads another's replies; TLS is on for ``tls://`` URLs or when any TLS file is given.
"""

from __future__ import annotations

import json
import os
import ssl
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

ENV = {"user": "INFERMESH_NATS_USER", "password": "INFERMESH_NATS_PASSWORD", "creds_file": "INFERMESH_NATS_CREDS",
       "tls_ca": "INFERMESH_NATS_TLS_CA", "tls_cert": "INFERMESH_NATS_TLS_CERT", "tls_key": "INFERMESH_NATS_TLS_KEY",
       "store_user": "INFERMESH_NATS_STORE_USER", "ledger_user": "INFERMESH_NATS_LEDGER_USER"}
CREDENTIALS_FD = "INFERMESH_NATS_CREDENTIALS_FD"  # an inherited pipe holding the credentials (JSON), read once
INBOX = "_INBOX"


@dataclass(frozen=True, slots=True)
class NatsCredentials:
    """Who connects and how the server is checked; every field optional (empty: not used)."""

    user: str = ""
    password: str = field(default="", repr=False)
    creds_file: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    store_user: str = ""
    ledger_user: str = ""

    def __post_init__(self) -> None:
        if self.password and not self.user:
            raise ValueError("a NATS password needs a user (INFERMESH_NATS_USER)")
        if self.creds_file and self.user:
            raise ValueError("give either a NATS user and password or a creds file, not both")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("a NATS client certificate needs its key, and the key its certificate")
        if (self.store_user or self.ledger_user) and not self.user:
            raise ValueError("a NATS store or ledger user goes with a user and password (INFERMESH_NATS_USER)")
        for user in (self.user, self.store_user, self.ledger_user):
            if any(c in user for c in ". *>\t\r\n"):
                raise ValueError(f"NATS user {user!r} must be one subject token (it names the user's inbox)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "NatsCredentials":
        """From ``env`` (default: what this process inherited through its pipe, else ``os.environ``)."""
        if env is None and INHERITED is not None:
            return INHERITED
        env = os.environ if env is None else env
        return cls(**{name: env.get(var, "") for name, var in ENV.items()})

    def store(self) -> "NatsCredentials":
        """Who connects to the STORE account (JetStream): the store user, same password; self if there is none."""
        return replace(self, user=self.store_user, store_user="", ledger_user="") if self.store_user else self

    def ledger(self) -> "NatsCredentials":
        """Who connects to the LEDGER account (the usage streams): the ledger user, same password; else whoever
        connects to STORE (a role with no ledger user, or an open server)."""
        return replace(self, user=self.ledger_user, store_user="", ledger_user="") if self.ledger_user else self.store()

    def pipe_to_child(self) -> tuple[int, dict[str, str]]:
        """A pipe holding these credentials (the child inherits its read end: pass it in ``pass_fds``, then close
        it here) and the env a child needs to read them: every ``INFERMESH_NATS_*`` secret variable emptied."""
        read_fd, write_fd = os.pipe()
        with os.fdopen(write_fd, "wb") as pipe:  # far under a pipe's buffer: never blocks
            pipe.write(json.dumps(asdict(self)).encode())
        return read_fd, {**{var: "" for var in ENV.values()}, CREDENTIALS_FD: str(read_fd)}

    def env(self) -> dict[str, str]:
        """Every ``INFERMESH_NATS_*`` variable, empty where unused: hands these credentials (and only these)
        to a child process, whatever it would inherit."""
        return {var: getattr(self, name) for name, var in ENV.items()}

    @property
    def inbox_prefix(self) -> str:
        return f"{INBOX}.{self.user}" if self.user else INBOX

    def uses_tls(self, url: str) -> bool:
        return url.startswith("tls://") or bool(self.tls_ca or self.tls_cert)

    def tls_context(self) -> ssl.SSLContext:
        """Verifies the server against ``tls_ca`` (else the system's CAs); presents the client certificate if any."""
        context = ssl.create_default_context(cafile=self.tls_ca or None)
        if self.tls_cert:
            context.load_cert_chain(self.tls_cert, self.tls_key)
        return context

    def connect_options(self, url: str) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect``."""
        options: dict[str, Any] = {"inbox_prefix": self.inbox_prefix}
        if self.user:
            options["user"] = self.user
            options["password"] = self.password
        if self.creds_file:
            options["user_credentials"] = self.creds_file
        if self.uses_tls(url):
            options["tls"] = self.tls_context()
        return options


def _take_inherited() -> NatsCredentials | None:
    """The credentials a parent handed down through ``INFERMESH_NATS_CREDENTIALS_FD``; the pipe is read, closed,
    and the variable dropped, so this process's own children never look for it."""
    fd = os.environ.pop(CREDENTIALS_FD, "")
    if not fd:
        return None
    with os.fdopen(int(fd), "rb") as pipe:
        return NatsCredentials(**json.loads(pipe.read()))


INHERITED = _take_inherited()
