"""Every NATS subject and JetStream bucket name used by infermesh, in one place.

All names start with a namespace (default ``im``) so that many meshes - and many
tests - can share one NATS server without hearing each other.

    <ns>.router.route                 request/reply  RouteRequest -> RouteReply
    <ns>.worker.<id>.generate         publish, reply=stream subject: GenerateRequest
    <ns>.worker.<id>.abort            publish        AbortRequest
    <ns>.worker.<id>.load             request/reply  LoadRequest -> LoadSnapshot
    <ns>.load.<id>                    publish        LoadSnapshot (on change + periodic)
    <ns>.kv.<id>                      publish        KvEventBatch
    <ns>.worker.<id>.kv_replay        request/reply  KvReplayRequest -> KvReplayReply
    <ns>.worker.<id>.kv_snapshot      request/reply  KvSnapshotRequest -> KvSnapshot
    <ns>.worker.<id>.ping             request/reply  WorkerPing -> WorkerPong (the liveness thread answers)
    <ns>.stream.<edge_id>.<req_id>    publish        StreamMessage (TokenChunk | StreamEnd | StreamError)
    <ns>.edge.<id>.ping               request/reply  EdgePing -> EdgePong (the edge's liveness thread answers)
    KV bucket <ns>_edges              key <id>       EdgeInfo, per-key TTL (lapses if the edge's heartbeats stop)
    <ns>.orphans.<worker_id>          JetStream <NS>_orphans  OrphanUsage: what a worker generated for a dead edge
    <ns>.router.decisions             publish        RouteDecisionEvent (replicas share pending load)
    <ns>.router.<id>.explain          request/reply  RouteRequest -> RouteReply, one replica, no side effects
    KV bucket <ns>_workers            key <id>       WorkerInfo, per-key TTL (lapses if heartbeats stop)
    <ns>.admission.acquire            request/reply  LeaseRequest -> LeaseGranted | LeaseRejected (the leader)
    <ns>.admission.renew              request/reply  LeaseRenew -> LeaseRenewReply
    <ns>.admission.release            publish        LeaseRelease
    <ns>.edge.<id>.revoked            publish        LeaseRevoked (admission -> the lease's edge: abort, 429 preempted)
    KV bucket <ns>_leases             key <lease>    LeaseRecord, per-key TTL; key "leader": the admission leader
    <ns>.outcome.<id>                 publish        Outcome (edge -> breaker)
    <ns>.breaker.transitions          publish        BreakerTransition
    KV bucket <ns>_sessions           key s-<hash>   SessionBinding, per-key idle TTL, CAS writes
    KV bucket <ns>_breakers           key <id>       BreakerRecord, CAS writes (probe permits too)
    <ns>.usage                        JetStream <NS>_usage   UsageEvent, dedupe id <request_id>:<attempt>
    <ns>.usage_dlq                    JetStream <NS>_usage_dlq  DeadLetter (usage metering can never write)
    KV bucket <ns>_api_keys           key <sha256>   ApiKeyRecord (metering keeps it in step with the ledger)
    KV bucket <ns>_billing            key prices     PriceSheet; key spend.<team>: TeamSpend
    <ns>.metering.keys_changed        publish        (empty): the CLI changed keys; metering syncs at once
    <ns>.responses.api.<operation>    request/reply  ResponsesApiRequest -> ResponsesApiReply (stored responses)
    object store <ns>_files           name file-<hex> the files of /v1/files (shared/files.py: chunks + info)
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NAMESPACE = "im"


def _check_token(value: str, what: str) -> str:
    if not value or any(c in value for c in ". *>\t\r\n"):
        raise ValueError(f"{what} {value!r} must be a non-empty NATS token (no '.', '*', '>' or spaces)")
    return value


@dataclass(frozen=True, slots=True)
class Subjects:
    """Subject names for one namespace."""

    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        _check_token(self.namespace, "namespace")

    # --- request/reply decisions
    @property
    def route(self) -> str:
        return f"{self.namespace}.router.route"

    def router_explain(self, router_id: str) -> str:
        """One replica's answer to a RouteRequest, without side effects (no binding, no load counted)."""
        return f"{self.namespace}.router.{_check_token(router_id, 'router id')}.explain"

    @property
    def route_decisions(self) -> str:
        return f"{self.namespace}.router.decisions"

    # --- per worker
    def worker_generate(self, worker_id: str) -> str:
        return f"{self.namespace}.worker.{_check_token(worker_id, 'worker id')}.generate"

    def worker_abort(self, worker_id: str) -> str:
        return f"{self.namespace}.worker.{worker_id}.abort"

    def worker_load(self, worker_id: str) -> str:
        return f"{self.namespace}.worker.{worker_id}.load"

    def worker_kv_replay(self, worker_id: str) -> str:
        return f"{self.namespace}.worker.{worker_id}.kv_replay"

    def worker_kv_snapshot(self, worker_id: str) -> str:
        return f"{self.namespace}.worker.{worker_id}.kv_snapshot"

    def worker_ping(self, worker_id: str) -> str:
        return f"{self.namespace}.worker.{worker_id}.ping"

    # --- broadcast streams
    def load(self, worker_id: str) -> str:
        return f"{self.namespace}.load.{worker_id}"

    @property
    def load_all(self) -> str:
        return f"{self.namespace}.load.*"

    def kv_events(self, worker_id: str) -> str:
        return f"{self.namespace}.kv.{worker_id}"

    @property
    def kv_events_all(self) -> str:
        return f"{self.namespace}.kv.*"

    @property
    def admission_acquire(self) -> str:
        return f"{self.namespace}.admission.acquire"

    @property
    def admission_renew(self) -> str:
        return f"{self.namespace}.admission.renew"

    @property
    def admission_release(self) -> str:
        return f"{self.namespace}.admission.release"

    def outcome(self, worker_id: str) -> str:
        return f"{self.namespace}.outcome.{worker_id}"

    @property
    def outcome_all(self) -> str:
        return f"{self.namespace}.outcome.*"

    @property
    def usage(self) -> str:
        return f"{self.namespace}.usage"

    @property
    def usage_stream(self) -> str:
        return f"{self.namespace}_usage"

    @property
    def usage_dead_letters(self) -> str:
        return f"{self.namespace}.usage_dlq"

    @property
    def usage_dead_letter_stream(self) -> str:
        return f"{self.namespace}_usage_dlq"

    @property
    def keys_changed(self) -> str:
        return f"{self.namespace}.metering.keys_changed"

    @property
    def breaker_transitions(self) -> str:
        return f"{self.namespace}.breaker.transitions"

    # --- token streams back to one edge
    def stream_prefix(self, edge_id: str) -> str:
        return f"{self.namespace}.stream.{_check_token(edge_id, 'edge id')}"

    def stream(self, edge_id: str, request_id: str) -> str:
        return f"{self.stream_prefix(edge_id)}.{request_id}"

    def edge_of_stream(self, subject: str) -> str | None:
        """The edge id in a token stream subject ``<ns>.stream.<edge_id>.<request_id>``; None for any other."""
        parts = subject.split(".")
        if len(parts) != 4 or parts[0] != self.namespace or parts[1] != "stream" or not parts[2] or not parts[3]:
            return None
        return parts[2]

    # --- per edge
    def edge_ping(self, edge_id: str) -> str:
        return f"{self.namespace}.edge.{_check_token(edge_id, 'edge id')}.ping"

    def edge_revoked(self, edge_id: str) -> str:
        return f"{self.namespace}.edge.{_check_token(edge_id, 'edge id')}.revoked"

    def orphans(self, worker_id: str) -> str:
        return f"{self.namespace}.orphans.{_check_token(worker_id, 'worker id')}"

    @property
    def orphans_all(self) -> str:
        return f"{self.namespace}.orphans.*"

    @property
    def orphans_stream(self) -> str:
        return f"{self.namespace}_orphans"

    # --- batch jobs (services/batch; docs/batch.md)
    @property
    def batch_line(self) -> str:
        """One line of a job, run by any edge (queue group ``edges``): BatchLineRequest -> BatchLineReply."""
        return f"{self.namespace}.batch.line"

    def responses_api(self, operation: str) -> str:
        """Metering's store of the Responses API's stored responses (shared/responses_schema.py): request/reply."""
        return f"{self.namespace}.responses.api.{_check_token(operation, 'responses operation')}"

    @property
    def responses_api_all(self) -> str:
        return f"{self.namespace}.responses.api.*"

    def batch_api(self, operation: str) -> str:
        """The batch service's API for edges (create, retrieve, list, cancel): request/reply."""
        return f"{self.namespace}.batch.api.{_check_token(operation, 'batch operation')}"

    def batch_team(self, team: str, read: str) -> str:
        """A team's reads of its own jobs (``shared.batch_schema.BatchTeamRead``: status, follow, results), asked of
        the batch service: request/reply; the service takes the team from the subject (a team user publishes its
        own team's only)."""
        return f"{self.namespace}.batch.team.{_check_token(team, 'team')}.{_check_token(read, 'batch team read')}"

    @property
    def batch_team_all(self) -> str:
        return f"{self.namespace}.batch.team.*.*"

    def batch_submit(self, team: str) -> str:
        return f"{self.namespace}.batch.submit.{_check_token(team, 'team')}"

    @property
    def batch_submit_all(self) -> str:
        return f"{self.namespace}.batch.submit.*"

    @property
    def batch_submit_stream(self) -> str:
        return f"{self.namespace}_batch_submit"

    def batch_events(self, team: str, job_id: str) -> str:
        return f"{self.namespace}.batch.events.{_check_token(team, 'team')}.{_check_token(job_id, 'job id')}"

    def batch_events_of(self, team: str) -> str:
        """Every job's events of one team (a team user's permission)."""
        return f"{self.namespace}.batch.events.{_check_token(team, 'team')}.>"

    @property
    def batch_events_all(self) -> str:
        return f"{self.namespace}.batch.events.>"

    @property
    def batch_events_stream(self) -> str:
        return f"{self.namespace}_batch_events"

    def batch_results(self, team: str, job_id: str) -> str:
        return f"{self.namespace}.batch.results.{_check_token(team, 'team')}.{_check_token(job_id, 'job id')}"

    def batch_results_of(self, team: str) -> str:
        return f"{self.namespace}.batch.results.{_check_token(team, 'team')}.>"

    @property
    def batch_results_all(self) -> str:
        return f"{self.namespace}.batch.results.>"

    @property
    def batch_results_stream(self) -> str:
        return f"{self.namespace}_batch_results"

    # --- JetStream KV buckets (bucket names allow no dots)
    @property
    def workers_bucket(self) -> str:
        return f"{self.namespace}_workers"

    @property
    def edges_bucket(self) -> str:
        return f"{self.namespace}_edges"

    @property
    def batch_bucket(self) -> str:
        """The batch service's leader key."""
        return f"{self.namespace}_batch"

    @property
    def leases_bucket(self) -> str:
        return f"{self.namespace}_leases"

    @property
    def breakers_bucket(self) -> str:
        return f"{self.namespace}_breakers"

    @property
    def sessions_bucket(self) -> str:
        return f"{self.namespace}_sessions"

    @property
    def api_keys_bucket(self) -> str:
        return f"{self.namespace}_api_keys"

    @property
    def billing_bucket(self) -> str:
        return f"{self.namespace}_billing"

    # --- JetStream object stores
    @property
    def files_bucket(self) -> str:
        """The files of ``/v1/files`` (batch inputs and outputs): ``shared/files.py``."""
        return f"{self.namespace}_files"
