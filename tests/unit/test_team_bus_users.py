"""Team users on the locked bus (infermesh/team_bus_users.py): made once, 0600, and a reload that rewrites only
the team users of the running server's config (the SIGHUP itself: tests/e2e/test_batch_bus.py)."""

from __future__ import annotations

import json
import stat
import subprocess
import sys

import pytest

from infermesh.bus_auth import load_or_create_secrets, server_config
from infermesh.bus_roles import Role, store_user
from infermesh.team_bus_users import (
    TEAM_SECRETS_FILE,
    add_team_user,
    record_running,
    reload_team_users,
    team_credentials,
)
from shared.batch_schema import BATCH_TEAM_READS
from shared.subjects import Subjects


def test_a_team_user_is_made_once_readable_by_this_user_only(tmp_path):
    first = add_team_user(tmp_path, "kappa")
    assert add_team_user(tmp_path, "kappa") == first and add_team_user(tmp_path, "lambda") != first
    assert stat.S_IMODE((tmp_path / TEAM_SECRETS_FILE).stat().st_mode) == 0o600
    credentials = team_credentials("kappa", tmp_path)
    assert (credentials.user, credentials.password, credentials.store_user) == ("team-kappa", first,
                                                                                "team-kappa@store")
    with pytest.raises(KeyError, match="infermesh teams bus-user mu"):
        team_credentials("mu", tmp_path)


def _store_users(config_path) -> list[dict]:
    return json.loads(config_path.read_text())["accounts"]["STORE"]["users"]


def test_a_reload_rewrites_the_team_users_and_keeps_the_roles(tmp_path):
    assert not reload_team_users(tmp_path)  # no locked server recorded here
    add_team_user(tmp_path, "kappa")
    config_path, pid_file = tmp_path / "nats.json", tmp_path / "nats.pid"
    config = server_config(4222, tmp_path / "store", Subjects("im"), load_or_create_secrets(tmp_path),
                           team_secrets={"kappa": "old", "gone": "x"}, pid_file=pid_file)
    config_path.write_text(json.dumps(config))
    assert config["pid_file"] == str(pid_file)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    pid_file.write_text(str(dead.pid))
    record_running(tmp_path, config_path, pid_file, "im", "nats://127.0.0.1:4222")
    add_team_user(tmp_path, "lambda")
    assert not reload_team_users(tmp_path)  # its server is gone: the config is rewritten for the next start
    assert [u["user"] for u in _store_users(config_path)] == [
        *(store_user(r.value) for r in Role), "team-kappa@store", "team-lambda@store"]
    mesh = json.loads(config_path.read_text())["accounts"]["MESH"]["users"]
    assert [u["user"] for u in mesh] == [*(r.value for r in Role), "team-kappa", "team-lambda"]  # its reads
    kappa = next(u for u in _store_users(config_path) if u["user"] == "team-kappa@store")
    assert kappa["password"] == team_credentials("kappa", tmp_path).password
    assert kappa["permissions"]["publish"]["allow"] == ["im.batch.submit.kappa"]  # no JetStream API call
    kappa = next(u for u in mesh if u["user"] == "team-kappa")
    assert kappa["password"] == team_credentials("kappa", tmp_path).password
    assert kappa["permissions"]["publish"]["allow"] == [f"im.batch.team.kappa.{r}" for r in BATCH_TEAM_READS]
    assert stat.S_IMODE(config_path.stat().st_mode) == 0o600
