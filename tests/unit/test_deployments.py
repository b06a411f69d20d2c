"""shared/deployments.py: the deployment list from the environment, and the deployment breaker on a fake clock."""

from __future__ import annotations

import pytest

from shared.deployments import (
    BreakerState,
    Deployment,
    DeploymentBreaker,
    DeploymentBreakerPolicy,
    DeploymentBreakers,
    Deployments,
    DeploymentsError,
    Ticket,
    Unavailable,
)

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
EAST, WEST, SOUTH = Deployment("east", "nsA"), Deployment("west", "nsB"), Deployment("south", "nsC")


# ---------------------------------------------------------------- the list
@pytest.mark.parametrize("env, local, others", [
    ({"INFERMESH_DEPLOYMENT": "east", "INFERMESH_DEPLOYMENTS": "east=nsA,west=nsB"}, EAST, (WEST,)),
    ({"INFERMESH_DEPLOYMENT": "west", "INFERMESH_DEPLOYMENTS": "east=nsA,west=nsB,south=nsC"}, WEST, (EAST, SOUTH)),
    ({"INFERMESH_DEPLOYMENT": "south", "INFERMESH_DEPLOYMENTS": " east = nsA , west=nsB,south=nsC "}, SOUTH,
     (EAST, WEST)),
    ({"INFERMESH_DEPLOYMENT": "east", "INFERMESH_DEPLOYMENTS": "east=nsA,west=nsB", "INFERMESH_NAMESPACE": "nsA"},
     EAST, (WEST,)),
    ({}, Deployment("local", "im"), ()),
    ({"INFERMESH_NAMESPACE": "prod"}, Deployment("local", "prod"), ()),
    ({"INFERMESH_DEPLOYMENT": "east", "INFERMESH_NAMESPACE": "prod"}, Deployment("east", "prod"), ()),
    ({"INFERMESH_DEPLOYMENTS": "  "}, Deployment("local", "im"), ()),
], ids=["two", "local-in-the-middle", "spaces", "namespace-agrees", "nothing", "namespace-only", "named-single",
        "blank-list"])
def test_the_local_deployment_comes_first_then_the_others_in_listed_order(env, local, others):
    deployments = Deployments.from_env(env)
    assert (deployments.local, deployments.others) == (local, others)
    assert deployments.in_order() == (local, *others)


@pytest.mark.parametrize("env, message", [
    ({"INFERMESH_DEPLOYMENTS": "east=nsA,west=nsB"}, "INFERMESH_DEPLOYMENT must name the local"),
    ({"INFERMESH_DEPLOYMENT": "north", "INFERMESH_DEPLOYMENTS": "east=nsA"}, "'north' is not in"),
    ({"INFERMESH_DEPLOYMENT": "east", "INFERMESH_DEPLOYMENTS": "east=nsA,west"}, "entry 2 'west' is not name="),
    ({"INFERMESH_DEPLOYMENT": "east", "INFERMESH_DEPLOYMENTS": "east=nsA,,west=nsB"}, "entry 2 '' is not"),
    ({"INFERMESH_DEPLOYMENT": "east", "INFERMESH_DEPLOYMENTS": "east=nsA,=nsB"}, "entry 2 '=nsB'"),
    ({"INFERMESH_DEPLOYMENT": "east", "INFERMESH_DEPLOYMENTS": "east="}, "entry 1 'east=' is not"),
    ({"INFERMESH_DEPLOYMENT": "east", "INFERMESH_DEPLOYMENTS": "east=nsA,east=nsB"}, "'east' is listed twice"),
    ({"INFERMESH_DEPLOYMENT": "east", "INFERMESH_DEPLOYMENTS": "east=nsA,west=nsA"}, "share namespace 'nsA'"),
    ({"INFERMESH_DEPLOYMENT": "east", "INFERMESH_DEPLOYMENTS": "east=ns.A"}, "deployment 'east': namespace"),
    ({"INFERMESH_DEPLOYMENT": "east", "INFERMESH_DEPLOYMENTS": "east=ns A"}, "must be a non-empty NATS token"),
    ({"INFERMESH_DEPLOYMENT": "e.st", "INFERMESH_DEPLOYMENTS": "e.st=nsA"}, "deployment name 'e.st'"),
    ({"INFERMESH_DEPLOYMENT": "e st"}, "deployment name 'e st'"),
    ({"INFERMESH_DEPLOYMENT": "east", "INFERMESH_DEPLOYMENTS": "east=nsA", "INFERMESH_NAMESPACE": "nsB"},
     "but INFERMESH_NAMESPACE='nsB'"),
], ids=["no-local", "unknown-local", "no-equals", "empty-entry", "no-name", "no-namespace", "twice",
        "shared-namespace", "dotted-namespace", "spaced-namespace", "dotted-name", "spaced-single",
        "namespace-disagrees"])
def test_a_bad_deployment_list_is_refused_with_what_is_wrong(env, message):
    with pytest.raises(DeploymentsError, match=message.replace("(", r"\(").replace(".", r"\.")):
        Deployments.from_env(env)


def test_a_deployment_reaches_its_namespace_subjects():
    assert WEST.subjects.route == "nsB.router.route" and WEST.subjects.workers_bucket == "nsB_workers"
    assert Deployments(EAST, (WEST,)).get("west") is WEST
    with pytest.raises(KeyError, match="no deployment 'north'"):
        Deployments(EAST, (WEST,)).get("north")


# ---------------------------------------------------------------- one breaker
POLICY = DeploymentBreakerPolicy(cooldown_s=2.0, probe_timeout_s=10.0)


def run(steps, policy: DeploymentBreakerPolicy = POLICY):
    """Feed (time, step) to one breaker. Steps: "admit" (keeps the ticket under the next number), "tick",
    ("down", n, reason) / ("ok", n) for ticket n. Returns the breaker, the tickets and the transitions."""
    breaker = DeploymentBreaker("west", "m", policy)
    tickets: list[Ticket | None] = []
    moves = []
    for now, step in steps:
        if step == "admit":
            tickets.append(breaker.admit(now))
            continue
        if step == "tick":
            move = breaker.tick(now)
        elif step[0] == "down":
            move = breaker.unavailable(tickets[step[1]], step[2], now)
        else:
            move = breaker.served(tickets[step[1]], now)
        if move is not None:
            moves.append((now, move.old.value, move.new.value, move.reason))
    return breaker, tickets, moves


@pytest.mark.parametrize("reason", list(Unavailable))
def test_one_report_of_unavailability_opens_a_closed_breaker(reason):
    breaker, tickets, moves = run([(0, "admit"), (0.5, ("down", 0, reason))])
    assert tickets[0] == Ticket("west", "m", 0) and moves == [(0.5, "closed", "open", reason.value)]
    assert breaker.state is OPEN


@pytest.mark.parametrize("steps, moves, state", [
    # served while closed: nothing to change
    ([(0, "admit"), (1, ("ok", 0))], [], CLOSED),
    # two requests out when it opens: the second's report is stale, and so is a late success
    ([(0, "admit"), (0, "admit"), (1, ("down", 0, Unavailable.NO_CAPACITY)),
      (1.5, ("down", 1, Unavailable.NO_LIVE_WORKER)), (1.6, ("ok", 1))],
     [(1, "closed", "open", "no_capacity")], OPEN),
    # open refuses until the cool-down ends; the first tick after it half-opens
    ([(0, "admit"), (0, ("down", 0, Unavailable.UNREACHABLE)), (1.9, "tick"), (1.95, "admit"), (2.0, "tick")],
     [(0, "closed", "open", "unreachable"), (2.0, "open", "half_open", "cooldown")], HALF_OPEN),
    # admit itself notices the cool-down ended and hands out the probe
    ([(0, "admit"), (0, ("down", 0, Unavailable.NO_CAPACITY)), (3, "admit"), (4, ("ok", 1))],
     [(0, "closed", "open", "no_capacity"), (4, "half_open", "closed", "probe_succeeded")], CLOSED),
    # a failed probe reopens, and the cool-down starts over from then
    ([(0, "admit"), (0, ("down", 0, Unavailable.NO_CAPACITY)), (2, "tick"), (2, "admit"),
      (2.5, ("down", 1, Unavailable.ALL_BREAKERS_OPEN)), (4.4, "tick"), (4.5, "tick")],
     [(0, "closed", "open", "no_capacity"), (2, "open", "half_open", "cooldown"),
      (2.5, "half_open", "open", "probe_failed"), (4.5, "open", "half_open", "cooldown")], HALF_OPEN),
    # a probe that never answers counts as failed after probe_timeout_s
    ([(0, "admit"), (0, ("down", 0, Unavailable.NO_CAPACITY)), (2, "admit"), (11.9, "tick"), (12, "tick")],
     [(0, "closed", "open", "no_capacity"), (12, "half_open", "open", "probe_timeout")], OPEN),
    # the timed-out probe answering late changes nothing
    ([(0, "admit"), (0, ("down", 0, Unavailable.NO_CAPACITY)), (2, "admit"), (12, "tick"), (12.5, ("ok", 1))],
     [(0, "closed", "open", "no_capacity"), (12, "half_open", "open", "probe_timeout")], OPEN),
    # a request admitted before the breaker opened, succeeding while half-open, is not the probe
    ([(0, "admit"), (0, "admit"), (0, ("down", 0, Unavailable.NO_CAPACITY)), (2, "tick"), (2.1, ("ok", 1))],
     [(0, "closed", "open", "no_capacity"), (2, "open", "half_open", "cooldown")], HALF_OPEN),
], ids=["served-closed", "stale-reports", "cooldown", "probe-closes", "probe-fails", "probe-timeout",
        "late-probe", "not-the-probe"])
def test_every_transition_of_the_deployment_breaker(steps, moves, state):
    breaker, _, seen = run(steps)
    assert seen == moves and breaker.state is state


def test_half_open_admits_exactly_one_probe_per_period():
    breaker, tickets, _ = run([(0, "admit"), (0, ("down", 0, Unavailable.NO_CAPACITY)), (1, "admit"),
                               (2, "admit"), (2.1, "admit")])
    assert tickets[1] is None  # open
    assert tickets[2] is not None and tickets[2].probe and tickets[3] is None
    assert breaker.state is HALF_OPEN


def test_a_zero_cool_down_half_opens_on_the_next_request():
    _, tickets, moves = run([(0, "admit"), (0, ("down", 0, Unavailable.NO_CAPACITY)), (0, "admit")],
                            DeploymentBreakerPolicy(cooldown_s=0))
    assert tickets[1] is not None and tickets[1].probe


# ---------------------------------------------------------------- all of them
def test_the_order_skips_open_deployments_and_comes_back_through_a_probe():
    breakers = DeploymentBreakers(Deployments(EAST, (WEST, SOUTH)), POLICY)
    assert breakers.order("m", 0) == [EAST, WEST, SOUTH]
    local = breakers.admit("east", "m", 0)
    breakers.unavailable(local, Unavailable.NO_CAPACITY, 0.1)
    assert breakers.order("m", 0.2) == [WEST, SOUTH]
    assert breakers.order("other-model", 0.2) == [EAST, WEST, SOUTH]  # one breaker per model
    west = breakers.admit("west", "m", 0.2)
    breakers.unavailable(west, Unavailable.UNREACHABLE, 0.3)
    assert breakers.order("m", 0.4) == [SOUTH]
    assert breakers.order("m", 2.1) == [EAST, SOUTH]  # east's cool-down is over: its probe may go
    probe = breakers.admit("east", "m", 2.1)
    assert probe is not None and probe.probe and breakers.admit("east", "m", 2.15) is None
    assert breakers.order("m", 2.2) == [SOUTH]  # east's probe is out, west still cools down
    assert breakers.order("m", 2.35) == [WEST, SOUTH]  # west is half-open now
    breakers.served(probe, 2.4)
    assert breakers.order("m", 2.45) == [EAST, WEST, SOUTH]
    assert breakers.state("east", "m", 2.5) is CLOSED and breakers.state("west", "m", 2.5) is HALF_OPEN
    assert [(t.deployment, t.new.value, t.reason) for t in breakers.drain_transitions()] == [
        ("east", "open", "no_capacity"), ("west", "open", "unreachable"), ("east", "half_open", "cooldown"),
        ("west", "half_open", "cooldown"), ("east", "closed", "probe_succeeded")]
    assert breakers.drain_transitions() == []


def test_with_every_breaker_open_there_is_nowhere_to_send():
    breakers = DeploymentBreakers(Deployments(EAST, (WEST,)), POLICY)
    for name in ("east", "west"):
        breakers.unavailable(breakers.admit(name, "m", 0), Unavailable.NO_LIVE_WORKER, 0)
    assert breakers.order("m", 1) == []
    with pytest.raises(KeyError):
        breakers.admit("north", "m", 1)
