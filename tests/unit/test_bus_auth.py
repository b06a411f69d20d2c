"""The locked bus's pure parts: credentials from the environment, the roles' permissions, secrets kept 0600."""

from __future__ import annotations

import json
import stat

import pytest

from infermesh.bus_auth import SECRETS_FILE, admin_credentials, load_or_create_secrets, server_config, tls_files
from infermesh.bus_roles import (
    LEDGER_ROLES,
    SERVICE_ROLES,
    Account,
    Role,
    account_of,
    account_permissions,
    buckets,
    permissions,
    team_permissions,
)
from shared.config import BusConfig, load_config
from shared.nats_auth import NatsCredentials
from shared.subjects import Subjects

S = Subjects("im")
ALL = {role: permissions(role, S) for role in Role}


def may_publish(role: Role, subject: str) -> bool:
    """Whether a literal subject passes the role's allow list and no denial (NATS wildcard matching)."""
    p = ALL[role]
    return any(_matches(a, subject) for a in p.publish) and not any(_matches(d, subject) for d in p.deny_publish)


def may_subscribe(role: Role, subject: str) -> bool:
    p = ALL[role]
    return any(_matches(a, subject) for a in p.subscribe) and not any(_matches(d, subject) for d in p.deny_subscribe)


def _matches(pattern: str, subject: str) -> bool:
    parts, tokens = pattern.split("."), subject.split(".")
    for i, part in enumerate(parts):
        if part == ">":
            return len(tokens) > i
        if i >= len(tokens) or (part != "*" and part != tokens[i]):
            return False
    return len(parts) == len(tokens)


def roles_that(check, subject: str) -> set[Role]:
    return {role for role in Role if check(role, subject)}


@pytest.mark.parametrize("subject, writers", [
    ("im.usage", {Role.EDGE}),
    ("$KV.im_api_keys.abc", {Role.METERING}),
    ("$KV.im_billing.spend.research", {Role.METERING}),
    ("$KV.im_leases.leader", {Role.ADMISSION}),
    ("$KV.im_workers.sim-0", {Role.WORKER}),
    ("$KV.im_edges.e1", {Role.EDGE}),
    ("$KV.im_sessions.s-1", {Role.ROUTER}),
    ("$KV.im_breakers.sim-0", {Role.BREAKER, Role.ROUTER}),  # routers take half-open probe permits by CAS
    ("im.worker.sim-0.generate", {Role.EDGE}),
    ("im.worker.sim-0.abort", {Role.EDGE}),
    ("im.metering.keys_changed", {Role.ADMIN}),
    ("im.usage_dlq", {Role.METERING}),
    ("im.responses.api.get", {Role.EDGE}),  # stored responses: an edge asks metering for its caller's team
    ("im.orphans.sim-0", {Role.WORKER}),
    ("im.stream.e1.r1", {Role.WORKER}),
    ("im.edge.e1.revoked", {Role.ADMISSION}),  # a batch lease taken back: its edge aborts the request
    ("$JS.API.STREAM.DELETE.KV_im_workers", set()),
    ("$JS.API.STREAM.PURGE.im_usage", set()),
    ("$JS.API.STREAM.UPDATE.KV_im_api_keys", set()),
    ("$JS.API.STREAM.MSG.DELETE.KV_im_billing", set()),
    ("$JS.API.STREAM.CREATE.KV_im_api_keys", {Role.ADMIN}),  # provisioning only
])
def test_each_write_belongs_to_the_roles_that_own_it(subject, writers):
    assert roles_that(may_publish, subject) == writers


@pytest.mark.parametrize("subject, readers", [
    ("im.stream.e1.r1", {Role.EDGE}),
    ("im.worker.sim-0.generate", {Role.WORKER}),
    ("im.router.route", {Role.ROUTER}),
    ("im.admission.acquire", {Role.ADMISSION}),
    ("im.edge.e1.revoked", {Role.EDGE}),
    ("im.outcome.sim-0", {Role.BREAKER}),
    ("im.metering.keys_changed", {Role.METERING}),
    ("im.responses.api.store", {Role.METERING}),
    ("_INBOX.edge.abc.1", {Role.EDGE}),
    ("_INBOX.abc", set()),
])
def test_each_subscription_belongs_to_the_roles_that_own_it(subject, readers):
    assert roles_that(may_subscribe, subject) == readers


def test_every_role_reads_replies_only_on_its_own_inbox_and_answers_only_when_it_serves_requests():
    for role, p in ALL.items():
        inboxes = [s for s in p.subscribe if s.startswith("_INBOX")]
        assert inboxes == [f"_INBOX.{role}.>"]
        assert not any(s.startswith("_INBOX") for s in p.publish)
    assert {r for r, p in ALL.items() if p.responds} == {Role.EDGE, Role.ROUTER, Role.ADMISSION, Role.WORKER,
                                                         Role.BATCH, Role.METERING}
    assert set(SERVICE_ROLES.values()) == set(Role) - {Role.ADMIN}
    assert len(buckets(S)) == len(set(buckets(S)))


def test_core_traffic_jetstream_and_the_usage_streams_are_split_between_the_three_accounts():
    """MESH carries no JetStream subject (it has no JetStream: no consumer there), STORE and LEDGER no core subject
    and no subscription but the user's own inbox (a consumer's delivery there reaches no service); LEDGER has the
    usage streams alone, and only metering and admin make consumers there."""
    for role in Role:
        split = {account: account_permissions(role, S, account) for account in Account}
        for account, part in split.items():
            assert all(account_of(p, S) is account for p in part.publish), (role, account)
        assert {p for part in split.values() for p in part.publish} == set(ALL[role].publish)  # nothing lost
        assert split[Account.MESH].subscribe == ALL[role].subscribe
        assert split[Account.STORE].subscribe == (f"_INBOX.{role}@store.>",)
        assert split[Account.LEDGER].subscribe == (f"_INBOX.{role}@ledger.>",)
        assert [a for a, part in split.items() if part.responds] == ([Account.MESH] if ALL[role].responds else [])
        consumers = [p for p in split[Account.LEDGER].publish if ".CONSUMER.CREATE." in p]
        assert bool(consumers) is (role in (Role.METERING, Role.ADMIN)), role
        assert bool(split[Account.LEDGER].publish) is (role in LEDGER_ROLES), role
    assert {account_of(s, S) for s in ("im.usage", "im.usage_dlq", "$JS.API.STREAM.INFO.im_usage",
                                       "$JS.API.CONSUMER.CREATE.im_usage_dlq.>", "$JS.ACK.im_usage.>")} == {
        Account.LEDGER}
    assert {account_of(s, S) for s in ("im.batch.submit.kappa", "$KV.im_workers.w", "$JS.API.STREAM.INFO.im_orphans",
                                       "$JS.API.CONSUMER.CREATE.KV_im_workers.>")} == {Account.STORE}
    assert {account_of(s, S) for s in ("im.batch.line", "im.worker.w.generate", "im.metering.keys_changed",
                                       "im.stream.e1.r1")} == {Account.MESH}


KAPPA = {account: team_permissions("kappa", S, account) for account in (Account.MESH, Account.STORE)}


def team_may(account: Account, check: str, subject: str) -> bool:
    p = KAPPA[account]
    allow, deny = (p.publish, p.deny_publish) if check == "pub" else (p.subscribe, p.deny_subscribe)
    return any(_matches(a, subject) for a in allow) and not any(_matches(d, subject) for d in deny)


MESH, STORE = Account.MESH, Account.STORE


@pytest.mark.parametrize("account, check, subject, allowed", [
    (STORE, "pub", "im.batch.submit.kappa", True),  # its submission (a JetStream publish: its ack on its inbox)
    (STORE, "pub", "im.batch.submit.lambda", False),  # another team's jobs: billed to it
    # no JetStream API call at all: no consumer (whose deliver_subject nats-server does not check), no get
    (STORE, "pub", "$JS.API.CONSUMER.CREATE.im_batch_events.c1.im.batch.events.kappa.batch_1", False),
    (STORE, "pub", "$JS.API.CONSUMER.CREATE.im_batch_results.c1.im.batch.results.kappa.batch_1", False),
    (STORE, "pub", "$JS.API.CONSUMER.DURABLE.CREATE.im_batch_results.c1", False),
    (STORE, "pub", "$JS.API.CONSUMER.CREATE.im_batch_results", False),
    (STORE, "pub", "$JS.API.DIRECT.GET.im_batch_events.im.batch.events.kappa.batch_1", False),
    (STORE, "pub", "$JS.API.STREAM.MSG.GET.im_batch_results", False),
    (STORE, "pub", "$JS.API.STREAM.INFO.im_batch_results", False),
    (STORE, "pub", "im.batch.results.kappa.batch_1", False),  # forging its own results or events
    (STORE, "pub", "im.batch.events.kappa.batch_1", False),
    (STORE, "pub", "$KV.im_api_keys.x", False),
    (STORE, "sub", "_INBOX.team-kappa@store.abc", True),
    (STORE, "sub", "_INBOX.team-lambda@store.abc", False),
    (STORE, "sub", "im.batch.results.kappa.batch_1", False),
    (MESH, "pub", "im.batch.team.kappa.status", True),  # its reads, asked of the batch service
    (MESH, "pub", "im.batch.team.kappa.follow", True),
    (MESH, "pub", "im.batch.team.kappa.results", True),
    (MESH, "pub", "im.batch.team.lambda.status", False),  # another team's jobs
    (MESH, "pub", "im.batch.team.kappa.cancel", False),  # reads only
    (MESH, "pub", "im.batch.api.retrieve", False),  # the edges' API names the team in its body
    (MESH, "pub", "im.batch.line", False),
    (MESH, "pub", "im.usage", False),
    (MESH, "sub", "_INBOX.team-kappa.abc", True),
    (MESH, "sub", "_INBOX.team-lambda.abc", False),
    (MESH, "sub", "_INBOX.batch.abc", False),
    (MESH, "sub", "im.batch.team.kappa.status", False),  # it asks; only the batch service answers
    (MESH, "sub", "im.stream.e1.r1", False),
])
def test_a_team_user_reaches_its_own_batch_jobs_only(account, check, subject, allowed):
    assert team_may(account, check, subject) is allowed
    assert not KAPPA[account].responds
    assert account_of(KAPPA[MESH].publish[0], S) is MESH and account_of(KAPPA[STORE].publish[0], S) is STORE


def test_credentials_travel_in_env_vars_that_the_service_configs_read():
    credentials = NatsCredentials("edge", "s3cret", tls_ca="/ca.pem", store_user="edge@store",
                                  ledger_user="edge@ledger")
    env = credentials.env()
    assert (credentials.store().user, credentials.ledger().user) == ("edge@store", "edge@ledger")
    assert credentials.ledger().password == "s3cret"
    assert NatsCredentials("worker", "pw", store_user="worker@store").ledger().user == "worker@store"  # no LEDGER user
    assert NatsCredentials.from_env(env) == credentials
    assert load_config(BusConfig, [], env).credentials() == credentials
    assert "s3cret" not in repr(credentials) and "s3cret" not in repr(load_config(BusConfig, [], env))
    assert NatsCredentials.from_env({}) == NatsCredentials()  # none: an open server


def test_connect_options_name_the_users_inbox_and_turn_tls_on_for_tls_urls_or_a_ca(tmp_path):
    assert NatsCredentials().connect_options("nats://h:1") == {"inbox_prefix": "_INBOX"}
    options = NatsCredentials("worker", "pw").connect_options("nats://h:1")
    assert options == {"inbox_prefix": "_INBOX.worker", "user": "worker", "password": "pw"}
    assert "tls" in NatsCredentials("worker", "pw").connect_options("tls://h:1")
    assert NatsCredentials(creds_file="/x.creds").connect_options("nats://h:1")["user_credentials"] == "/x.creds"


@pytest.mark.parametrize("fields", [{"password": "pw"}, {"user": "a", "creds_file": "/x"}, {"tls_cert": "/c"},
                                    {"user": "a.b"}])
def test_credentials_that_cannot_work_are_refused_at_once(fields):
    with pytest.raises(ValueError):
        NatsCredentials(**fields)


def test_secrets_are_made_once_readable_by_this_user_only_and_reused(tmp_path):
    first = load_or_create_secrets(tmp_path / "data")
    path = tmp_path / "data" / SECRETS_FILE
    assert set(first) == set(Role) and len(set(first.values())) == len(Role)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_or_create_secrets(tmp_path / "data") == first
    stored = json.loads(path.read_text())
    del stored["worker"]  # a role added since: it gets a secret, the others keep theirs
    path.write_text(json.dumps(stored))
    path.chmod(0o644)
    again = load_or_create_secrets(tmp_path / "data")
    assert again[Role.WORKER] != first[Role.WORKER] and again[Role.EDGE] == first[Role.EDGE]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_admin_cli_uses_the_env_credentials_else_the_stored_admin_else_none(tmp_path, monkeypatch):
    for var in NatsCredentials().env():
        monkeypatch.delenv(var, raising=False)
    assert admin_credentials(tmp_path) == NatsCredentials()
    secrets = load_or_create_secrets(tmp_path)
    assert admin_credentials(tmp_path) == NatsCredentials("admin", secrets[Role.ADMIN], store_user="admin@store",
                                                          ledger_user="admin@ledger")
    monkeypatch.setenv("INFERMESH_NATS_USER", "ops")
    monkeypatch.setenv("INFERMESH_NATS_PASSWORD", "theirs")
    assert admin_credentials(tmp_path) == NatsCredentials("ops", "theirs")


def test_the_server_config_has_a_user_per_role_and_tls_when_asked(tmp_path):
    secrets = load_or_create_secrets(tmp_path)
    config = server_config(4222, tmp_path / "js", S, secrets)
    mesh, store, ledger = (config["accounts"][a] for a in ("MESH", "STORE", "LEDGER"))  # type: ignore[index]
    users = {u["user"]: u for u in mesh["users"]}
    assert set(users) == {r.value for r in Role} and users["edge"]["password"] == secrets[Role.EDGE]
    assert {u["user"]: u["password"] for u in store["users"]} == {f"{r.value}@store": secrets[r] for r in Role}
    assert {u["user"]: u["password"] for u in ledger["users"]} == {
        f"{r.value}@ledger": secrets[r] for r in (Role.EDGE, Role.ADMISSION, Role.METERING, Role.ADMIN)}
    assert store["jetstream"] == ledger["jetstream"] == "enabled" and "jetstream" not in mesh  # no consumer in MESH
    assert config["listen"] == "127.0.0.1:4222" and "tls" not in config
    tls = tls_files("cert.pem", "key.pem", "ca.pem")
    assert tls is not None and tls.cert.startswith("/")
    assert server_config(4222, tmp_path, S, secrets, tls)["tls"]["cert_file"] == tls.cert  # type: ignore[index]
    assert tls_files() is None
    with pytest.raises(SystemExit):
        tls_files(cert="cert.pem")
