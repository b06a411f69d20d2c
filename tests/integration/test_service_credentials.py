"""Under ``infermesh up`` each service gets its own bus credentials and no other's, and none in its environment.

``ProcessGroup.python_service`` starts the service as ``up`` does; the service here is a stand-in module named
like a role (``<package>.edge``), which reports what it was given. Before, the credentials were in the child's
environment, which ``/proc/<pid>/environ`` shows to any process of the same user for the child's whole life.
"""

from __future__ import annotations

import json
from pathlib import Path

from infermesh.bus_auth import load_or_create_secrets, role_credentials
from infermesh.bus_roles import Role
from infermesh.processes import ProcessGroup

REPORT = '''
import json, os
from shared.nats_auth import NatsCredentials
CREDENTIALS_FD = "INFERMESH_NATS_CREDENTIALS_FD"
from shared.config import BusConfig, load_config

environ = open("/proc/self/environ", "rb").read().decode(errors="replace")
fd = dict(v.split("=", 1) for v in environ.split("\\0") if "=" in v).get(CREDENTIALS_FD, "")
try:
    os.fstat(int(fd))
    fd_open = True
except (OSError, ValueError):
    fd_open = False
print(json.dumps({"from_env": NatsCredentials.from_env().__repr__(), "password": NatsCredentials.from_env().password,
                  "config": load_config(BusConfig, []).credentials().password, "environ": environ,
                  "fd_given": bool(fd), "fd_open": fd_open, "fd_var_left": CREDENTIALS_FD in os.environ}))
'''


def test_a_service_reads_only_its_own_credentials_and_none_are_in_its_environment(tmp_path, monkeypatch):
    package = tmp_path / "stand_in"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "edge.py").write_text(REPORT)
    secrets = load_or_create_secrets(tmp_path / "secrets")
    group = ProcessGroup(tmp_path / "logs")
    group.bus_credentials = {role.value: role_credentials(role, secrets) for role in Role}
    monkeypatch.setenv("INFERMESH_NATS_PASSWORD", secrets[Role.ADMIN])  # an operator's, in up's own environment
    root = Path(__file__).resolve().parents[2]
    child = group.python_service("edge", "stand_in.edge", [], {"PYTHONPATH": f"{tmp_path}:{root}"})
    assert child.popen.wait(60) == 0, child.tail()
    report = json.loads(child.log_path.read_text().strip().splitlines()[-1])
    leaked = [role.value for role, secret in secrets.items() if secret in report["environ"]]
    assert leaked == [], f"the child's environment holds the secrets of {leaked}"
    assert report["password"] == secrets[Role.EDGE] and report["config"] == secrets[Role.EDGE]
    assert "edge@store" in report["from_env"] and secrets[Role.EDGE] not in report["from_env"]
    assert report["fd_given"] and not report["fd_open"] and not report["fd_var_left"]  # read once, then gone
