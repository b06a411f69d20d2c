"""Who may do what on a locked bus: one NATS user per service role, each with publish and subscribe allow lists.

Three accounts (``Account``): nats-server does not check a JetStream push consumer's ``deliver_subject`` against
its maker's permissions, so wherever a role may make a consumer it may deliver anywhere in that account. MESH
has no JetStream (no consumer can be made there) and carries every core subject; STORE holds the streams, KV
buckets and object stores but the usage ones, and nothing listens there but private inboxes and the streams
(which store a delivery, if at all, under its original subject: see docs/architecture.md); LEDGER holds only
the usage stream and its dead-letter stream, and only metering (a consumer on usage) and admin (one on the dead
letters) make consumers there, so no other role's delivery can take the room of unread usage. Each role has a
user in MESH and STORE, ``<role>`` and ``<role>@store`` (``store_user``), and the edge, metering, admission and
admin one in LEDGER, ``<role>@ledger`` (``ledger_user``, ``LEDGER_ROLES``), one password; ``account_permissions``
splits ``permissions`` between them (``account_of``: the usage streams' subjects and API calls are LEDGER's,
other ``$JS``, ``$KV``, ``$O`` and stream subjects STORE's, the rest MESH's). A team has a user in MESH and
STORE, ``team-<team>`` and ``team-<team>@store``, and none in LEDGER.

Derived from ``shared/subjects.py`` (``<ns>`` is the namespace; a KV put is a publish on ``$KV.<bucket>.<key>``,
a KV read a consumer on ``KV_<bucket>`` or a direct get; JetStream API calls are publishes on ``$JS.API.>``):

| role      | publishes                                                       | subscribes                      |
|-----------|-----------------------------------------------------------------|---------------------------------|
| edge      | router.route, worker.*.generate/abort/ping, admission.*,        | stream.> (token streams),       |
|           | outcome.*, usage (LEDGER); the orphans consumer's acks;         | edge.*.ping, edge.*.revoked,    |
|           | batch.api.* (the Batch API, asked of the batch service),        | batch.line (queue edges)        |
|           | responses.api.* (stored responses, asked of metering)           |                                 |
| router    | router.decisions, worker.*.kv_replay/kv_snapshot; replies       | router.route, router.*.explain, |
|           |                                                                 | router.decisions, kv.*, load.*  |
| admission | replies (lease grants); the usage stream's info (LEDGER)        | admission.*                     |
|           | edge.*.revoked (a batch lease taken back), edge.*.ping (gone?)  |                                 |
| breaker   | breaker.transitions                                             | outcome.*                       |
| metering  | acks on the usage stream, usage_dlq (dead letters; both in      | metering.keys_changed, usage    |
|           | LEDGER); replies (stored responses)                             | (durable consumer, LEDGER),     |
|           |                                                                 | responses.api.*                 |
| worker    | stream.> (tokens), load.*, kv.*, orphans.* (JetStream),         | worker.>                        |
|           | edge.*.ping; replies (load, kv pages, pong)                     |                                 |
| batch     | batch.line (asks an edge), batch.results.> and batch.events.>   | batch.api.*, batch.team.*.*     |
|           | (JetStream); the submissions consumer's acks; replies           | (a team's reads of its jobs)    |
| admin     | metering.keys_changed, worker.*.load/ping, edge.*.ping,         | —                               |
|           | router.*.explain; creates the buckets and streams (provision;   |                                 |
|           | the usage ones in LEDGER), reads the dead letters (LEDGER)      |                                 |

A team's own program on the bus (``infermesh/batch_client.py``) connects as the team's user, ``team-<team>``
(``team_permissions``; made with ``infermesh teams bus-user``). In STORE it publishes ``batch.submit.<team>``
(a JetStream publish and its ack) and no other team's, and calls no JetStream API: it makes no consumer, so it
cannot have one deliver onto another stream's subjects (nats-server does not check a ``deliver_subject``),
replaying its results into the shared batch streams until they are full. In MESH it asks the batch service for
its own jobs, ``batch.team.<team>.{status,follow,results}`` (services/batch/team_reads.py), and no other team's:
the service takes the team from the subject. It subscribes only its own inbox in each account.

| role      | KV writes            | KV reads                    |
|-----------|----------------------|-----------------------------|
| edge      | edges (heartbeats)   | workers, breakers, api_keys |
| router    | sessions, breakers   | workers                     |
|           | (probe permits)      |                             |
| admission | leases               | workers, billing, edges     |
| breaker   | breakers             | workers                     |
| metering  | api_keys, billing    | —                           |
| worker    | workers (heartbeats) | edges                       |
| batch     | batch (leader key)   | —                           |
| admin     | —                    | workers, edges              |
|           |                      | usage_dlq (dead letters)    |

| role      | object stores (read, write, list, delete: ``object_store_access``)                       |
|-----------|-------------------------------------------------------------------------------------------|
| edge      | files (``/v1/files`` for its callers: ``shared/files.py``)                                |
| batch     | files (a job's input, its ``batch_output`` files)                                         |

Invariants: each role subscribes to replies only on its own inbox, ``_INBOX.<role>.>`` (so no role reads another's
replies); a role answers requests only through ``allow_responses`` (one reply per request received) unless the
subject is in its list; every role is denied stream update, delete and purge and message delete, ``$KV`` writes
on every bucket it does not write (``$O`` for an object store), ``<ns>.usage`` unless it is the edge,
``<ns>.usage_dlq`` unless it is metering, ``batch.line``, ``batch.results.>`` and ``batch.events.>`` unless it
is batch. Only admin creates buckets (``provision``, before any service starts),
so no service can be the first to make one with a config of its own; the edge and metering send the usage
streams' ``STREAM.CREATE`` (as ``ensure_usage_stream`` does on every start), edges and workers the orphans
stream's, which on a stream that exists is a no-op or refused, never a change. A writer of an object store may
purge that store's stream and no other (deleting an object purges its chunks): a stray purge there loses files,
never another stream's messages. Responders answer only ``_INBOX.`` reply subjects (``shared.bus.is_reply_inbox``):
NATS lets a reply through whatever the responder's own deny list says.

In LEDGER the edge publishes usage (and sends its stream's ``STREAM.CREATE``/``INFO``), admission reads the usage
stream's info: neither makes a consumer. Metering's consumers are on the usage stream, admin's on the dead
letters; a push consumer of theirs may deliver onto ``<ns>.usage`` or ``<ns>.usage_dlq``, where the stream stores
it under its original subject: metering's usage messages come back to it as usage (a duplicate: the ledger's
unique (request_id, attempt) key drops it) or sit among the dead letters; admin's dead letters in the usage
stream stay under ``<ns>.usage_dlq``, which metering's consumer (filtered on ``<ns>.usage``) never reads. Either
can take room there, as both already can by their own rights (metering acks usage, admin provisions).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.batch_schema import BATCH_TEAM_READS
from shared.nats_auth import INBOX
from shared.subjects import Subjects

JS = "$JS.API"
ALWAYS_DENIED = (f"{JS}.STREAM.UPDATE.>", f"{JS}.STREAM.DELETE.>", f"{JS}.STREAM.PURGE.>",
                 f"{JS}.STREAM.MSG.DELETE.>")
RESPONSE_WINDOW = "5m"  # how long a received request may still be answered (admission queues up to ~wait_s)


class Account(enum.StrEnum):
    """The locked server's three NATS accounts (see the module docstring): core traffic, JetStream, and the
    usage streams."""

    MESH = "MESH"
    STORE = "STORE"
    LEDGER = "LEDGER"


STORE_USER_SUFFIX = "@store"  # a role's user in STORE: <role>@store (same password as its MESH user)
LEDGER_USER_SUFFIX = "@ledger"  # a role's user in LEDGER: <role>@ledger (LEDGER_ROLES only; same password)


class Role(enum.StrEnum):
    EDGE = "edge"
    ROUTER = "router"
    ADMISSION = "admission"
    BREAKER = "breaker"
    METERING = "metering"
    WORKER = "worker"
    BATCH = "batch"
    ADMIN = "admin"


LEDGER_ROLES = frozenset({Role.EDGE, Role.METERING, Role.ADMISSION, Role.ADMIN})  # the roles with a LEDGER user
SERVICE_ROLES = {f"services.{r.value}": r for r in Role if r is not Role.ADMIN}  # service module -> its role
TEAM_USER_PREFIX = "team-"  # a team's NATS user: team-<team> (team names are letters, digits, '_' and '-')


@dataclass(frozen=True, slots=True)
class Permissions:
    """One NATS user's permissions: allow lists, denials that win over them, and whether it may answer requests."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    deny_publish: tuple[str, ...]
    deny_subscribe: tuple[str, ...]
    responds: bool

    def server_block(self) -> dict[str, object]:
        """The user's ``permissions`` block in a nats-server config."""
        block: dict[str, object] = {
            "publish": {"allow": list(self.publish), "deny": list(self.deny_publish)},
            "subscribe": {"allow": list(self.subscribe), "deny": list(self.deny_subscribe)},
        }
        if self.responds:
            block["allow_responses"] = {"max": 1, "expires": RESPONSE_WINDOW}
        return block


def kv_reads(bucket: str) -> tuple[str, ...]:
    """Open the bucket (stream info: ``provision`` made it), watch it (ordered consumers, flow control), get keys."""
    stream = f"KV_{bucket}"
    return (f"{JS}.STREAM.INFO.{stream}", f"{JS}.CONSUMER.CREATE.{stream}",
            f"{JS}.CONSUMER.CREATE.{stream}.>", f"{JS}.CONSUMER.DELETE.{stream}.>", f"{JS}.CONSUMER.INFO.{stream}.>",
            f"{JS}.DIRECT.GET.{stream}", f"{JS}.DIRECT.GET.{stream}.>", f"{JS}.STREAM.MSG.GET.{stream}",
            f"$JS.FC.{stream}.>")


def kv_writes(bucket: str) -> tuple[str, ...]:
    return (*kv_reads(bucket), f"$KV.{bucket}.>")


def stream_publish(stream: str, subject: str) -> tuple[str, ...]:
    """Publish to a JetStream stream, making sure it exists first (``STREAM.CREATE``: a no-op if it does)."""
    return f"{JS}.STREAM.CREATE.{stream}", f"{JS}.STREAM.INFO.{stream}", subject


def stream_consume(stream: str) -> tuple[str, ...]:
    """Pull from a durable consumer on the stream (made if absent) and ack."""
    return (f"{JS}.STREAM.CREATE.{stream}", f"{JS}.STREAM.INFO.{stream}", f"{JS}.CONSUMER.CREATE.{stream}",
            f"{JS}.CONSUMER.CREATE.{stream}.>", f"{JS}.CONSUMER.DURABLE.CREATE.{stream}.>",
            f"{JS}.CONSUMER.INFO.{stream}.>", f"{JS}.CONSUMER.MSG.NEXT.{stream}.>", f"$JS.ACK.{stream}.>")


def stream_read(stream: str) -> tuple[str, ...]:
    """Read a stream without consuming it for anyone: ephemeral consumers and message gets (an operator's view)."""
    return (f"{JS}.STREAM.INFO.{stream}", f"{JS}.CONSUMER.CREATE.{stream}", f"{JS}.CONSUMER.CREATE.{stream}.>",
            f"{JS}.CONSUMER.DELETE.{stream}.>", f"{JS}.STREAM.MSG.GET.{stream}", f"$JS.FC.{stream}.>")


def object_store_access(bucket: str) -> tuple[str, ...]:
    """Put, get, list (an ordered consumer on the infos), delete (a deleted info, then its chunks purged)."""
    stream = f"OBJ_{bucket}"
    return (f"{JS}.STREAM.INFO.{stream}", f"{JS}.CONSUMER.CREATE.{stream}", f"{JS}.CONSUMER.CREATE.{stream}.>",
            f"{JS}.CONSUMER.DELETE.{stream}.>", f"{JS}.CONSUMER.INFO.{stream}.>", f"{JS}.DIRECT.GET.{stream}",
            f"{JS}.DIRECT.GET.{stream}.>", f"{JS}.STREAM.MSG.GET.{stream}", f"$JS.FC.{stream}.>",
            f"{JS}.STREAM.PURGE.{stream}", f"$O.{bucket}.>")


def object_stores(s: Subjects) -> tuple[str, ...]:
    return (s.files_bucket,)


def buckets(s: Subjects) -> tuple[str, ...]:
    return (s.workers_bucket, s.edges_bucket, s.leases_bucket, s.breakers_bucket, s.sessions_bucket,
            s.api_keys_bucket, s.billing_bucket, s.batch_bucket)


def streams(s: Subjects) -> tuple[str, ...]:
    """Every JetStream stream of the namespace: the KV buckets', the object stores' and the three plain ones."""
    return (*(f"KV_{b}" for b in buckets(s)), *(f"OBJ_{b}" for b in object_stores(s)), s.usage_stream,
            s.usage_dead_letter_stream, s.orphans_stream, *batch_streams(s))


def batch_streams(s: Subjects) -> tuple[str, ...]:
    return (s.batch_submit_stream, s.batch_results_stream, s.batch_events_stream)


def _grants(role: Role, s: Subjects) -> tuple[tuple[str, ...], tuple[str, ...], frozenset[str], bool]:
    """(publish, subscribe, buckets written, answers requests) of one role, before the common parts."""
    ns, worker, edge = s.namespace, f"{s.namespace}.worker.*", f"{s.namespace}.edge.*"
    if role is Role.EDGE:
        return ((s.route, f"{worker}.generate", f"{worker}.abort", f"{worker}.ping", f"{ns}.admission.*",
                 s.outcome_all, *stream_publish(s.usage_stream, s.usage), *stream_consume(s.orphans_stream),
                 *kv_reads(s.workers_bucket), *kv_reads(s.breakers_bucket), *kv_reads(s.api_keys_bucket),
                 *kv_writes(s.edges_bucket), *object_store_access(s.files_bucket), f"{ns}.batch.api.*",
                 s.responses_api_all),
                (f"{ns}.stream.>", f"{edge}.ping", f"{edge}.revoked", s.batch_line),
                frozenset({s.edges_bucket, s.files_bucket}), True)
    if role is Role.BATCH:  # jobs: runs lines through the edges, keeps results and events, reads submissions
        return ((s.batch_line, *stream_publish(s.batch_results_stream, s.batch_results_all),
                 *stream_read(s.batch_results_stream), *stream_publish(s.batch_events_stream, s.batch_events_all),
                 *stream_consume(s.batch_submit_stream), *kv_writes(s.batch_bucket),
                 *object_store_access(s.files_bucket)),
                (f"{ns}.batch.api.*", s.batch_team_all), frozenset({s.batch_bucket, s.files_bucket}), True)
    if role is Role.ROUTER:
        return ((s.route_decisions, f"{worker}.kv_replay", f"{worker}.kv_snapshot", *kv_reads(s.workers_bucket),
                 *kv_writes(s.breakers_bucket), *kv_writes(s.sessions_bucket)),
                (s.route, f"{ns}.router.*.explain", s.route_decisions, s.kv_events_all, s.load_all),
                frozenset({s.breakers_bucket, s.sessions_bucket}), True)
    if role is Role.ADMISSION:
        # the usage stream's last sequence: how far the ledger must get before a lapsed lease's hold clears
        return ((*kv_reads(s.workers_bucket), *kv_reads(s.billing_bucket), *kv_writes(s.leases_bucket),
                 *kv_reads(s.edges_bucket), f"{JS}.STREAM.INFO.{s.usage_stream}", f"{edge}.revoked", f"{edge}.ping"),
                (f"{ns}.admission.*",), frozenset({s.leases_bucket}), True)
    if role is Role.BREAKER:
        return ((s.breaker_transitions, *kv_reads(s.workers_bucket), *kv_writes(s.breakers_bucket)),
                (s.outcome_all,), frozenset({s.breakers_bucket}), False)
    if role is Role.METERING:
        return ((*stream_consume(s.usage_stream), *stream_publish(s.usage_dead_letter_stream, s.usage_dead_letters),
                 *kv_writes(s.api_keys_bucket), *kv_writes(s.billing_bucket)),
                (s.keys_changed, s.responses_api_all), frozenset({s.api_keys_bucket, s.billing_bucket}), True)
    if role is Role.WORKER:
        return ((f"{ns}.stream.>", s.load_all, s.kv_events_all, f"{edge}.ping",
                 *stream_publish(s.orphans_stream, s.orphans_all), *kv_reads(s.edges_bucket),
                 *kv_writes(s.workers_bucket)),
                (f"{ns}.worker.>",), frozenset({s.workers_bucket}), True)
    provision = tuple(f"{JS}.STREAM.{verb}.{stream}" for stream in streams(s) for verb in ("INFO", "CREATE"))
    return ((s.keys_changed, f"{worker}.load", f"{worker}.ping", f"{edge}.ping", f"{ns}.router.*.explain",
             f"{JS}.INFO", *provision, *stream_read(s.usage_dead_letter_stream), *kv_reads(s.workers_bucket),
             *kv_reads(s.edges_bucket)),
            (), frozenset(), False)


# Subjects only one role may publish (JetStream streams a forgery would land in): role -> subjects.
OWN_PUBLISH = {Role.EDGE: lambda s: (s.usage,), Role.METERING: lambda s: (s.usage_dead_letters,),
               Role.WORKER: lambda s: (s.orphans_all,),
               Role.BATCH: lambda s: (s.batch_line, s.batch_results_all, s.batch_events_all)}


def _always_denied(s: Subjects, writes: frozenset[str]) -> tuple[str, ...]:
    """ALWAYS_DENIED, but a writer of an object store may purge that store's stream (and no other)."""
    purgeable = {f"OBJ_{b}" for b in object_stores(s) if b in writes}
    if not purgeable:
        return ALWAYS_DENIED
    purges = tuple(f"{JS}.STREAM.PURGE.{stream}" for stream in streams(s) if stream not in purgeable)
    return (*(d for d in ALWAYS_DENIED if d != f"{JS}.STREAM.PURGE.>"), *purges)


def permissions(role: Role, subjects: Subjects) -> Permissions:
    publish, subscribe, writes, responds = _grants(role, subjects)
    deny = (*_always_denied(subjects, writes), *(f"$KV.{b}.>" for b in buckets(subjects) if b not in writes),
            *(f"$O.{b}.>" for b in object_stores(subjects) if b not in writes),
            *(subject for owner, owned in OWN_PUBLISH.items() if owner is not role for subject in owned(subjects)))
    return Permissions(
        publish=tuple(dict.fromkeys(publish)),
        subscribe=(f"{INBOX}.{role.value}.>", *subscribe),
        deny_publish=deny,
        deny_subscribe=() if role is Role.EDGE else (f"{subjects.namespace}.stream.>",),
        responds=responds,
    )


def store_user(user: str) -> str:
    return f"{user}{STORE_USER_SUFFIX}"


def ledger_user(user: str) -> str:
    return f"{user}{LEDGER_USER_SUFFIX}"


def account_user(role: Role, account: Account) -> str:
    """The role's user name in ``account``."""
    return {Account.MESH: role.value, Account.STORE: store_user(role.value),
            Account.LEDGER: ledger_user(role.value)}[account]


def ledger_streams(s: Subjects) -> tuple[str, ...]:
    return (s.usage_stream, s.usage_dead_letter_stream)


def account_of(subject: str, s: Subjects) -> Account:
    """The account a subject (or pattern) belongs to: LEDGER, the usage streams' subjects and the JetStream API
    calls, acks and flow control naming those streams; STORE, the other JetStream, KV and object store subjects
    and the subjects a stream captures; MESH, everything else (core traffic)."""
    ns, tokens = s.namespace, subject.split(".")
    if subject in (s.usage, s.usage_dead_letters) or (tokens[0] == "$JS" and set(tokens[1:]) & set(ledger_streams(s))):
        return Account.LEDGER
    if subject.startswith(("$JS.", "$KV.", "$O.", f"{ns}.orphans.", f"{ns}.batch.submit.", f"{ns}.batch.results.",
                           f"{ns}.batch.events.")):
        return Account.STORE
    return Account.MESH


def account_permissions(role: Role, subjects: Subjects, account: Account) -> Permissions:
    """The part of ``permissions`` that applies in ``account``: MESH, the core subjects (and answering requests);
    STORE and LEDGER, their JetStream subjects, with replies on the role's own inbox there only. The denials go
    to every account."""
    whole = permissions(role, subjects)
    return Permissions(
        publish=tuple(p for p in whole.publish if account_of(p, subjects) is account),
        subscribe=(f"{INBOX}.{account_user(role, account)}.>",
                   *(p for p in whole.subscribe[1:] if account_of(p, subjects) is account)),
        deny_publish=whole.deny_publish, deny_subscribe=whole.deny_subscribe,
        responds=whole.responds and account is Account.MESH)


def team_user(team: str) -> str:
    return f"{TEAM_USER_PREFIX}{team}"


def team_permissions(team: str, s: Subjects, account: Account) -> Permissions:
    """A team's program (see the module docstring): in MESH, its reads of its own jobs, asked of the batch service
    (``batch.team.<team>.<read>``); in STORE, its own submissions (a publish and its ack) and no JetStream API call,
    so no consumer, whose deliveries nats-server would not check. It has no user in LEDGER."""
    if account is Account.MESH:
        publish, user = tuple(s.batch_team(team, read) for read in BATCH_TEAM_READS), team_user(team)
    else:
        publish, user = (s.batch_submit(team),), store_user(team_user(team))
    deny = ("$JS.>", "$KV.>", "$O.>", *(subject for owned in OWN_PUBLISH.values() for subject in owned(s)))
    return Permissions(publish=publish, subscribe=(f"{INBOX}.{user}.>",), deny_publish=deny,
                       deny_subscribe=(f"{s.namespace}.stream.>",), responds=False)
