"""infermesh/nats_topology.py: names, ports and configs of a supercluster, without starting a server."""

from __future__ import annotations

from pathlib import Path

import pytest

from infermesh.nats_topology import free_ports, plan_supercluster


def counting(start: int = 10000):
    return lambda n: list(range(start, start + n))


def test_two_clusters_of_three_and_a_witness_get_distinct_names_ports_and_stores(tmp_path: Path):
    plan = plan_supercluster(["east", "west"], 3, tmp_path, ports=counting())
    assert plan.cluster_names == ["east", "west", "witness"]
    assert [s.name for s in plan.servers()] == ["east-0", "east-1", "east-2", "west-0", "west-1", "west-2",
                                                "witness-0"]
    ports = [p for s in plan.servers() for p in (s.ports.client, s.ports.route, s.ports.gateway, s.ports.monitor)]
    assert sorted(ports) == list(range(10000, 10000 + 4 * 7))
    assert len({s.store_dir for s in plan.servers()}) == 7
    assert plan.url("west") == plan.server("west-0").url


def test_a_server_routes_to_its_cluster_and_gateways_to_every_other_cluster(tmp_path: Path):
    plan = plan_supercluster(["east", "west"], 2, tmp_path, ports=counting())
    config = plan.config(plan.server("east-1"))
    assert config["server_name"] == "east-1" and config["jetstream"] == {"store_dir": str(tmp_path / "store" /
                                                                                          "east-1")}
    assert config["cluster"]["name"] == "east"
    assert config["cluster"]["routes"] == [s.route_url for s in plan.servers("east")]  # itself included
    gateways = {g["name"]: g["urls"] for g in config["gateway"]["gateways"]}
    assert gateways == {"west": [s.gateway_url for s in plan.servers("west")],
                        "witness": [plan.server("witness-0").gateway_url]}
    assert config["gateway"]["name"] == "east" and "domain" not in config["jetstream"]
    assert "ping_interval" not in config


def test_ping_interval_and_no_witness(tmp_path: Path):
    plan = plan_supercluster(["a", "b", "c"], 1, tmp_path, witness=False, ping_interval_s=0.5, ports=counting())
    assert plan.cluster_names == ["a", "b", "c"]
    config = plan.config(plan.server("b-0"))
    assert (config["ping_interval"], config["ping_max"]) == ("500ms", 2)


def test_servers_on_hosts_of_their_own_listen_and_route_on_their_addresses(tmp_path: Path):
    hosts = ["10.0.0.10", "10.0.0.11", "10.0.0.12"]
    plan = plan_supercluster(["c"], 3, tmp_path, witness=False, ports=counting(), hosts=hosts)
    assert [s.host for s in plan.servers()] == hosts
    config = plan.config(plan.server("c-1"))
    assert config["listen"] == f"10.0.0.11:{plan.server('c-1').ports.client}"
    assert config["cluster"]["routes"] == [s.route_url for s in plan.servers()]
    assert plan.server("c-2").url.startswith("nats://10.0.0.12:")
    with pytest.raises(ValueError, match="2 hosts for 3 servers"):
        plan_supercluster(["c"], 3, tmp_path, witness=False, ports=counting(), hosts=hosts[:2])


@pytest.mark.parametrize("names, servers, message", [
    ([], 1, "at least one"),
    (["east", "east"], 1, "distinct"),
    (["east", "witness"], 1, "witness cluster's name"),
    (["ea.st"], 1, "letters, digits"),
    (["east"], 0, "at least 1"),
])
def test_a_bad_plan_is_refused(tmp_path: Path, names, servers, message):
    with pytest.raises(ValueError, match=message):
        plan_supercluster(names, servers, tmp_path, ports=counting())


def test_free_ports_are_distinct():
    ports = free_ports(64)
    assert len(set(ports)) == 64
