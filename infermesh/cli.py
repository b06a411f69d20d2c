"""The ``infermesh`` command.

    infermesh up [--engine vllm|sim] [--workers N] [--model NAME] [--model-path DIR]
                 [--http-port P] [--nats-url URL] [--namespace NS] [--trace-ui [--trace-ui-port P]]
                 [--nats-tls-cert F --nats-tls-key F [--nats-tls-ca F]]   (NATS over TLS)
    infermesh up --pd P:D [--prefill-token-budget N] [--decode-token-budget N]   (disaggregated, NIXL)
    infermesh up --sim-decoders N [--sim-prefill M] [--sim-profile NAME] [--sim-clock-factor X]
                 [--sim-stream-interval K] [--sim-engines-per-process P] --model NAME --model-path DIR
    infermesh prepare-model [--tiny DIR]
    infermesh teams create NAME | teams list | teams bus-user NAME
    infermesh keys create --team T [--name N] [--admin] | keys revoke PREFIX | keys list [--team T]
    infermesh prices set --model M --input X --cached-input Y --output Z [--effective-from ISO] | prices list
    infermesh budgets set --team T --usd X [--month YYYY-MM]
      (the ledger's admin commands: see infermesh/admin_cli.py)
    infermesh batch submit FILE [--model M] [--endpoint E] [--wait] | batch list | batch status ID
                    | batch cancel ID | batch results ID [--errors] [-o OUT]
      (a team's batch jobs through the edge, with a key: see infermesh/batch_cli.py)
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from infermesh import admin_cli, batch_cli

DEFAULT_MODEL = "gemma-3-270m"
UP_DESCRIPTION = (
    "Runs NATS, router, breaker, admission, metering, the workers and the edge as processes and supervises "
    "them: one that dies is logged and restarted after 0.5 s, doubling to 30 s while it keeps crashing "
    "(reset once it stays up 30 s; a crash loop is retried every 30 s), while the rest keeps serving. "
    "Ctrl-C or SIGTERM stops everything, restarting nothing. Logs: STATE_DIR/logs/NAME.log.")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infermesh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="run the whole mesh on this machine", description=UP_DESCRIPTION)
    up.add_argument("--engine", choices=["vllm", "sim"], default=None,
                    help="default: vllm, or sim with --sim-decoders/--sim-prefill")
    up.add_argument("--workers", type=int, default=1, help="number of workers (vllm: at most one per core)")
    up.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
    up.add_argument("--model-path", default="", help="model folder (default: Gemma 3 270M, converted once)")
    up.add_argument("--http-port", type=int, default=8000)
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--nats-url", default="", help="use this NATS (JetStream on) instead of starting one "
                    "(credentials: $INFERMESH_NATS_USER/_PASSWORD or _CREDS; TLS CA: $INFERMESH_NATS_TLS_CA)")
    up.add_argument("--nats-tls-cert", default="", help="TLS for the NATS up starts: its certificate (PEM)")
    up.add_argument("--nats-tls-key", default="", help="... its private key (PEM)")
    up.add_argument("--nats-tls-ca", default="", help="... the CA the services check it with (default: the system's)")
    up.add_argument("--namespace", default="im")
    up.add_argument("--router-replicas", type=int, default=2, help="router processes (they agree; one may die)")
    up.add_argument("--admission-replicas", type=int, default=2, help="admission processes (a leader, standbys)")
    up.add_argument("--edge-replicas", type=int, default=2,
                    help="edge processes sharing --http-port (SO_REUSEPORT; a dead one loses only its own requests)")
    up.add_argument("--max-model-len", type=int, default=8192)
    up.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM CPU KV cache per worker")
    up.add_argument("--sim-ttft-ms", type=float, default=20.0)
    up.add_argument("--sim-itl-ms", type=float, default=10.0)
    pd = up.add_argument_group("disaggregated prefill/decode")
    pd.add_argument("--pd", default="", metavar="P:D",
                    help="P prefill and D decode workers (vllm: KV over NIXL, at most 2 engines here; sim: the pools)")
    pd.add_argument("--prefill-token-budget", type=int, default=0, help="prefill pool's tokens per step (0: default)")
    pd.add_argument("--decode-token-budget", type=int, default=0, help="decode pool's tokens per step (0: default)")
    fleet = up.add_argument_group("simulated fleet (sim engine)")
    fleet.add_argument("--sim-decoders", type=int, default=0,
                       help="serving sim engines instead of --workers (role decode when --sim-prefill > 0)")
    fleet.add_argument("--sim-prefill", type=int, default=0, help="prefill-role sim engines")
    fleet.add_argument("--sim-profile", default="", help="step-time profile, e.g. gb200-glm53 (default: fixed timings)")
    fleet.add_argument("--sim-clock-factor", type=float, default=1.0, help="simulated seconds per real second")
    fleet.add_argument("--sim-stream-interval", type=int, default=1, help="tokens per streamed message")
    fleet.add_argument("--sim-engines-per-process", type=int, default=1,
                       help="sim engines sharing one worker process")
    up.add_argument("--reasoning-parser", default="", choices=("", "deepseek_r1", "qwen3", "glm45"),
                    help="the served model thinks (<think>...</think>): the edge separates its thought "
                    "(services/edge/README.md, 'Reasoning models')")
    up.add_argument("--sim-script", default="", metavar="FILE",
                    help="sim engine: scripted answers, JSON rules the prompt picks from "
                    "(services/worker/README.md, 'Scripted answers')")
    up.add_argument("--database-url", default=os.environ.get("INFERMESH_DATABASE_URL", ""),
                    help="the billing ledger (postgresql://...); default: the embedded SQLite file")
    up.add_argument("--billing-port", type=int, default=8001, help="billing API and team dashboards")
    up.add_argument("--metrics-port-base", type=int, default=9464,
                    help="each service's Prometheus /metrics on this port and the next ones (0: any free, -1: none)")
    up.add_argument("--trace-ui", action="store_true",
                    help="start Phoenix, a trace UI, and send every service's spans to it (installed once into its "
                    "own virtualenv, ~850 MB; see infermesh/trace_ui.py)")
    up.add_argument("--trace-ui-port", type=int, default=6006, help="Phoenix's UI and OTLP/HTTP port")
    up.add_argument("--state-dir", default="", help="logs and NATS store (default: a new temp folder)")
    up.add_argument("--ready-timeout", type=float, default=600.0)

    prepare = commands.add_parser("prepare-model", help="convert the embedded default model once (cached)")
    prepare.add_argument("--tiny", default="", help="instead, write the tiny random test model to this folder")

    admin_cli.add_commands(commands)
    batch_cli.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in admin_cli.COMMANDS:
        return admin_cli.run(args)
    if args.command in batch_cli.COMMANDS:
        return batch_cli.run(args)
    if args.command == "prepare-model":
        from infermesh import models

        path = models.make_tiny_llama(Path(args.tiny)) if args.tiny else models.prepare_gemma()
        print(path)
        return 0
    if args.command == "up":
        from infermesh.up import MeshOptions, run_mesh

        key = os.environ.get("INFERMESH_DEV_KEY") or f"im-dev-{secrets.token_urlsafe(18)}"
        fleet = args.sim_decoders > 0 or args.sim_prefill > 0
        options = MeshOptions(
            engine=args.engine or ("sim" if fleet else "vllm"), num_workers=args.workers, model=args.model,
            model_path=args.model_path,
            host=args.host, http_port=args.http_port, nats_url=args.nats_url, namespace=args.namespace,
            nats_tls_cert=args.nats_tls_cert, nats_tls_key=args.nats_tls_key, nats_tls_ca=args.nats_tls_ca,
            max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib, sim_ttft_ms=args.sim_ttft_ms,
            sim_itl_ms=args.sim_itl_ms, state_dir=args.state_dir, dev_key=key, ready_timeout_s=args.ready_timeout,
            sim_decoders=args.sim_decoders, sim_prefill=args.sim_prefill, sim_profile=args.sim_profile,
            sim_clock_factor=args.sim_clock_factor, sim_stream_interval=args.sim_stream_interval,
            sim_engines_per_process=args.sim_engines_per_process, sim_script=args.sim_script,
            reasoning_parser=args.reasoning_parser,
            database_url=args.database_url,
            billing_port=args.billing_port, metrics_port_base=args.metrics_port_base, pd=args.pd,
            trace_ui=args.trace_ui, trace_ui_port=args.trace_ui_port,
            prefill_token_budget=args.prefill_token_budget,
            decode_token_budget=args.decode_token_budget, router_replicas=args.router_replicas,
            admission_replicas=args.admission_replicas, edge_replicas=args.edge_replicas,
        )
        return run_mesh(options)
    return 2


if __name__ == "__main__":
    sys.exit(main())
