"""shared/config.py: defaults < INFERMESH_* env < --flags."""

from __future__ import annotations

import dataclasses

import pytest

from services.worker.config import WorkerConfig
from shared.config import BusConfig, load_config


@dataclasses.dataclass(slots=True)
class Sample(BusConfig):
    count: int = 3
    ratio: float = 0.5
    verbose: bool = False
    limit: int | None = None
    label: str | None = None


@pytest.mark.parametrize(
    "env, argv, expected",
    [
        ({}, [], {"count": 3, "ratio": 0.5, "verbose": False, "limit": None, "namespace": "im",
                  "nats_url": "nats://127.0.0.1:4222"}),
        ({"INFERMESH_COUNT": "7", "INFERMESH_RATIO": "1.5", "INFERMESH_NAMESPACE": "ns"}, [],
         {"count": 7, "ratio": 1.5, "namespace": "ns"}),
        ({"INFERMESH_COUNT": "7"}, ["--count", "9"], {"count": 9}),  # flags beat env
        ({"INFERMESH_NATS_URL": "nats://env:1"}, ["--nats-url", "nats://flag:2"], {"nats_url": "nats://flag:2"}),
        ({"INFERMESH_LIMIT": "12", "INFERMESH_LABEL": "x"}, [], {"limit": 12, "label": "x"}),  # X | None parsed as X
        ({}, ["--limit", "4"], {"limit": 4}),
        ({"COUNT": "8", "INFERMESH_count": "8"}, [], {"count": 3}),  # only exact INFERMESH_<UPPER> names
        # booleans
        ({"INFERMESH_VERBOSE": "true"}, [], {"verbose": True}),
        ({"INFERMESH_VERBOSE": "Yes"}, [], {"verbose": True}),
        ({"INFERMESH_VERBOSE": "1"}, [], {"verbose": True}),
        ({"INFERMESH_VERBOSE": "0"}, [], {"verbose": False}),
        ({"INFERMESH_VERBOSE": "off"}, [], {"verbose": False}),
        ({}, ["--verbose"], {"verbose": True}),
        ({"INFERMESH_VERBOSE": "true"}, ["--no-verbose"], {"verbose": False}),
        ({"INFERMESH_VERBOSE": "false"}, ["--verbose"], {"verbose": True}),
    ],
)
def test_load_config(env, argv, expected):
    config = load_config(Sample, argv=argv, env=env)
    assert {k: getattr(config, k) for k in expected} == expected
    assert all(type(getattr(config, k)) is type(v) for k, v in expected.items())


@pytest.mark.parametrize(
    "env, argv",
    [
        ({"INFERMESH_COUNT": "many"}, []),
        ({"INFERMESH_RATIO": "half"}, []),
        ({"INFERMESH_VERBOSE": "maybe"}, []),
        ({"INFERMESH_LIMIT": ""}, []),
        ({}, ["--count", "x"]),
        ({}, ["--unknown", "1"]),
    ],
)
def test_bad_values_exit(env, argv):
    with pytest.raises(SystemExit):
        load_config(Sample, argv=argv, env=env)


def test_bad_env_value_names_the_variable():
    with pytest.raises(SystemExit) as info:
        load_config(Sample, env={"INFERMESH_COUNT": "many"})
    assert "INFERMESH_COUNT" in str(info.value.code)


@pytest.mark.parametrize(
    "env, argv",
    [
        ({"INFERMESH_ROLE": "bogus"}, []),
        ({}, ["--role", "bogus"]),
        ({}, ["--engine", "gpu"]),
        ({"INFERMESH_HEARTBEAT_S": "5"}, []),  # ttl (3 s) must exceed heartbeat
    ],
)
def test_post_init_assertion_fires(env, argv):
    with pytest.raises(AssertionError):
        load_config(WorkerConfig, argv=argv, env=env)


def test_worker_config_from_env_and_flags():
    config = load_config(WorkerConfig, argv=["--role", "decode", "--sim-itl-ms", "2.5"],
                         env={"INFERMESH_WORKER_ID": "w1", "INFERMESH_BLOCK_SIZE": "32"})
    assert (config.worker_id, config.role, config.sim_itl_ms, config.block_size) == ("w1", "decode", 2.5, 32)
