"""How a process proves who it is to NATS and checks the server: a user and password or a creds file, and TLS.

    credentials = NatsCredentials.from_env()    # INFERMESH_NATS_USER, _PASSWORD, _CREDS, _TLS_CA, _TLS_CERT, _TLS_KEY
    nc = await nats.connect(url, **credentials.connect_options(url))
    child_env = credentials.env()                # the same variables, for a child process (never its argv)

| field          | env var                     | meaning                                                         |
|----------------|-----------------------------|-----------------------------------------------------------------|
| ``user``       | ``INFERMESH_NATS_USER``     | the NATS user (``infermesh up``: the service's role)            |
| ``password``   | ``INFERMESH_NATS_PASSWORD`` | its password (needs ``user``)                                   |
| ``creds_file`` | ``INFERMESH_NATS_CREDS``    | a ``.creds`` file (JWT + nkey seed) instead of user/password    |
| ``tls_ca``     | ``INFERMESH_NATS_TLS_CA``   | the CA that signed the server's certificate (else the system's) |
| ``tls_cert``   | ``INFERMESH_NATS_TLS_CERT`` | a client certificate, for servers that verify clients           |
| ``tls_key``    | ``INFERMESH_NATS_TLS_KEY``  | its private key (``tls_cert`` and ``tls_key`` go together)      |

Invariants: no credentials means an anonymous connection (an open server, as in the tests); a user's
replies come back on ``_INBOX.<user>.>``, the only inbox a locked server lets that user subscribe to, so
one role never reads another's replies; TLS is on for ``tls://`` URLs or when any TLS file is given.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from typing import Any, Mapping

ENV = {"user": "INFERMESH_NATS_USER", "password": "INFERMESH_NATS_PASSWORD", "creds_file": "INFERMESH_NATS_CREDS",
       "tls_ca": "INFERMESH_NATS_TLS_CA", "tls_cert": "INFERMESH_NATS_TLS_CERT", "tls_key": "INFERMESH_NATS_TLS_KEY"}
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

    def __post_init__(self) -> None:
        if self.password and not self.user:
            raise ValueError("a NATS password needs a user (INFERMESH_NATS_USER)")
        if self.creds_file and self.user:
            raise ValueError("give either a NATS user and password or a creds file, not both")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("a NATS client certificate needs its key, and the key its certificate")
        if any(c in self.user for c in ". *>\t\r\n"):
            raise ValueError(f"NATS user {self.user!r} must be one subject token (it names the user's inbox)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "NatsCredentials":
        env = os.environ if env is None else env
        return cls(**{name: env.get(var, "") for name, var in ENV.items()})

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
