"""Run one service as a process: config, logging, tracing, bus, signals, clean stop."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from typing import Awaitable, Callable, Protocol, Sequence, TypeVar

from prometheus_client import CollectorRegistry

from shared.bus import Bus
from shared.config import BusConfig, load_config
from shared.metrics import MetricsServer
from shared.telemetry import setup_tracing

C = TypeVar("C", bound=BusConfig)
STOP_TIMEOUT_S = 10.0


class Service(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )


async def serve(name: str, config: BusConfig, build: Callable[[Bus], Service | Awaitable[Service]]) -> None:
    """Connect, start the service, wait for SIGINT/SIGTERM, stop it and close the bus."""
    setup_tracing(f"infermesh-{name}")
    bus = await Bus.connect(config.nats_url, config.namespace, f"infermesh-{name}", config.credentials())
    built = build(bus)
    service = await built if asyncio.iscoroutine(built) else built
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await service.start()  # type: ignore[union-attr]
    metrics = await _serve_metrics(name, config, service)
    # Everything allocated so far (modules, tokenizers, engine state) lives for the whole process:
    # keep it out of the collector's scans so per-request garbage collection stays short.
    gc.collect()
    gc.freeze()
    # a service that can fail on its own (a worker whose engine will not restart) sets ``fatal``: stop, exit 1
    fatal: asyncio.Event | None = getattr(service, "fatal", None)
    waits = [asyncio.ensure_future(e.wait()) for e in (stop, fatal) if e is not None]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
        # Bounded: with NATS gone, unsubscribe/drain could wait for a reconnect forever.
        steps = [service.stop, bus.close] if metrics is None else [metrics.stop, service.stop, bus.close]
        for step in steps:  # type: ignore[union-attr]
            try:
                await asyncio.wait_for(step(), STOP_TIMEOUT_S)
            except (asyncio.TimeoutError, Exception) as exc:
                logging.getLogger(name).warning("shutdown step did not finish cleanly: %r", exc)
    if fatal is not None and fatal.is_set() and not stop.is_set():
        logging.getLogger(name).critical("%s failed on its own: exiting 1 (a supervisor restarts it)", name)
        raise SystemExit(1)


async def _serve_metrics(name: str, config: BusConfig, service: Service) -> MetricsServer | None:
    """The service's Prometheus registry (``service.metrics``) on ``--metrics-port``, if asked for."""
    registry = getattr(service, "metrics", None)
    if config.metrics_port < 0 or not isinstance(registry, CollectorRegistry):
        return None
    health = getattr(service, "healthy", None)
    server = MetricsServer(registry, config.metrics_host, config.metrics_port,
                           health if callable(health) else (lambda: True))
    try:
        port = await server.start()
    except OSError as exc:  # (the port is taken): metrics must never keep a service from serving
        logging.getLogger(name).warning("no metrics: cannot listen on %s:%d (%s)", config.metrics_host,
                                        config.metrics_port, exc)
        return None
    logging.getLogger(name).info("metrics on http://%s:%d/metrics", config.metrics_host, port)
    return server


def main(name: str, config_type: type[C], build: Callable[[C, Bus], Service],
         argv: Sequence[str] | None = None) -> None:
    config = load_config(config_type, sys.argv[1:] if argv is None else argv)
    setup_logging(config.log_level, name)
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(serve(name, config, lambda bus: build(config, bus)))
    finally:
        _cancel_leftovers(loop)
        loop.close()


def _cancel_leftovers(loop: asyncio.AbstractEventLoop, timeout_s: float = 3.0) -> None:
    """Cancel tasks still running after shutdown, waiting at most ``timeout_s``.

    asyncio.run waits for them without a bound; a library task that swallows its
    cancellation (e.g. a NATS reconnect loop) would keep a dying process alive.
    """
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.wait(tasks, timeout=timeout_s))
