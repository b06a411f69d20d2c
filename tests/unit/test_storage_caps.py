"""Every stream's max_bytes inside the server's max_file_store (shared/storage_caps.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from infermesh.bus_auth import load_or_create_secrets, server_config
from shared.storage_caps import DEFAULT_STORE_BYTES, ENV, max_file_store, store_bytes, store_caps
from shared.subjects import Subjects


@pytest.mark.parametrize("env, total", [({}, DEFAULT_STORE_BYTES), ({ENV: str(64 << 20)}, 64 << 20),
                                        ({ENV: " "}, DEFAULT_STORE_BYTES)])
def test_the_caps_share_the_namespace_budget_and_the_server_holds_them_with_headroom(env, total):
    caps = store_caps(env)
    assert store_bytes(env) == total and total * 0.99 <= caps.total() <= total
    assert caps.files == total // 2 and min(caps.usage, caps.kv_bucket, caps.orphans) > 0
    assert max_file_store(env) >= caps.total() * 1.2


@pytest.mark.parametrize("value", ["lots", "-1", str(1 << 20)])
def test_a_wrong_budget_fails_loudly(value):
    with pytest.raises(ValueError, match=ENV):
        store_caps({ENV: value})


def test_the_locked_server_config_sets_max_file_store(tmp_path: Path):
    config = server_config(4222, tmp_path / "store", Subjects("im"), load_or_create_secrets(tmp_path))
    assert config["jetstream"] == {"store_dir": str(tmp_path / "store"), "max_file_store": max_file_store()}
