"""A vLLM engine core SIGKILLed under a streaming request: the stream fails at once with a retryable error, the worker
leaves the registry (the breaker sees it), refuses generates while a fresh engine starts in its process, and
serves again under a new ``started_at``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import nats.errors
import openai
import psutil
import pytest

from infermesh.local import LocalMesh
from shared import schema
from shared.bus import Bus
from shared.registry import WorkerDirectory
from shared.schema import BreakerTransition, GenerateRequest, SamplingParams, StreamError, WorkerInfo
from tests.utils import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]
KEY = "test-key"
WORKER = "vllm-0"


def _engine_cores(pid: int | None = None) -> list[psutil.Process]:
    """vLLM's engine core processes among the descendants of ``pid`` (this process): titled VLLM::EngineCore."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "EngineCore" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue  # gone, or a zombie
    return found


async def _generate_is_refused_at_once(probe: Bus) -> float:
    """A generate sent straight to the restarting worker: no-responders (unsubscribed) or its StreamError."""
    request = GenerateRequest("direct-1", "tiny", [5, 6, 7, 8], SamplingParams(max_tokens=4))
    started = time.monotonic()
    try:
        reply = await probe.nc.request(probe.subjects.worker_generate(WORKER), schema.encode(request), timeout=10)
        message = schema.decode(reply.data, schema.StreamMessage)
        assert isinstance(message, StreamError) and message.code == "worker_unavailable", message
    except nats.errors.NoRespondersError:
        pass
    return time.monotonic() - started


async def test_a_killed_engine_core_fails_its_stream_fast_and_the_worker_serves_again(nats_url, namespace,
                                                                                     tiny_model):
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    probe = await Bus.connect(nats_url, namespace, "probe")
    directory = WorkerDirectory(probe)
    left, joined = [], []
    directory.on_removed.append(lambda wid: left.append((time.monotonic(), wid)))
    directory.on_added.append(lambda info: joined.append((time.monotonic(), info)))
    transitions: list[BreakerTransition] = []

    async def on_transition(t: BreakerTransition, _raw) -> None:
        transitions.append(t)

    try:
        await directory.start()
        await probe.subscribe(probe.subjects.breaker_transitions, BreakerTransition, on_transition)
        await mesh.start_breaker()
        await mesh.start_router()
        worker = await mesh.start_worker(worker_id=WORKER, engine="vllm", model="tiny", model_path=str(tiny_model),
                                         max_model_len=1024, cpu_core=0)
        edge = await mesh.start_edge()
        await eventually(edge.mesh.is_ready, 30)
        await eventually(lambda: WORKER in directory.workers, 10)
        first: WorkerInfo = directory.workers[WORKER]
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0)
        (core,) = _engine_cores()

        stream = await client.completions.create(model="tiny", prompt="the mesh of small services", max_tokens=900,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks, killed_at = 0, 0.0
        with pytest.raises(openai.APIError) as failed:
            async for _chunk in stream:
                chunks += 1
                if chunks == 1:  # in flight: tokens streamed, hundreds to go
                    os.kill(core.pid, signal.SIGKILL)
                    killed_at = time.monotonic()
        failed_after_s = time.monotonic() - killed_at
        # worker_unavailable, in the client's stable words (services/edge/errors.py: no worker ids in error bodies)
        assert chunks < 900 and "became unavailable" in str(failed.value), failed.value
        assert failed_after_s < 5, failed_after_s  # at once, not after a deadline

        await eventually(lambda: any(wid == WORKER for _, wid in left), 10)  # it left the registry
        # opened: it left the registry ("heartbeat"), unless the edge's failed attempt had opened it first
        await eventually(lambda: any(t.worker_id == WORKER and t.new == "open" for t in transitions), 10)
        if not any(info.worker_id == WORKER and at > killed_at for at, info in joined):  # still restarting
            assert await _generate_is_refused_at_once(probe) < 1.0

        await eventually(lambda: any(info.worker_id == WORKER and at > killed_at for at, info in joined), 120)
        assert directory.workers[WORKER].started_at > first.started_at  # a new incarnation
        (fresh_core,) = _engine_cores()
        assert fresh_core.pid != core.pid and worker.restarts.restarts == 1

        async def serves() -> bool:
            try:
                reply = await client.completions.create(model="tiny", prompt="back again", max_tokens=8,
                                                        temperature=0)
            except openai.APIStatusError as exc:
                assert exc.status_code == 503, exc  # the breaker's reset or the router's view is on its way
                return False
            return reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens > 0

        await eventually(serves, 30, interval_s=0.2)
        serving_again_s = time.monotonic() - killed_at
        print(f"\nkill -> stream failed {failed_after_s:.2f} s, -> serving again {serving_again_s:.1f} s")
        # the breaker saw it back: closed on registering again (or by its half-open probe, if it cooled down first)
        await eventually(lambda: any(t.worker_id == WORKER and t.new == "closed" for t in transitions), 10)
    finally:
        await mesh.stop()
        await directory.stop()
        await probe.close()
        for leftover in _engine_cores():
            leftover.kill()


def test_a_worker_whose_engine_will_not_start_again_exits_non_zero_for_its_supervisor(nats_url, namespace, tmp_path):
    """The fresh engine cannot start (its model folder is gone): three tries with backoff, then the process exits 1
    (``infermesh up`` restarts a process that exits; it does not restart an engine inside one)."""
    from infermesh.models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny")
    env = {**os.environ, "INFERMESH_NATS_URL": nats_url, "INFERMESH_NAMESPACE": namespace}
    worker = subprocess.Popen([sys.executable, "-m", "services.worker", "--engine", "vllm", "--worker-id", "vllm-1",
                               "--model", "tiny", "--model-path", str(model), "--max-model-len", "1024",
                               "--cpu-core", "0"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert worker.stdout is not None
        for line in worker.stdout:  # until it serves (or exits)
            lines.append(line)
            if "worker vllm-1 serving" in line:  # not vLLM's "Reducing Torch threads ... for serving"
                break
        assert "worker vllm-1 serving" in lines[-1], "".join(lines[-30:])
        (core,) = _engine_cores(worker.pid)
        model.rename(tmp_path / "gone")
        core.kill()
        lines += list(worker.stdout)  # to its exit
        assert worker.wait(60) == 1, "".join(lines[-30:])
        log = "".join(lines)
        assert log.count("starting a fresh engine failed") == 3 and "could not be restarted" in log, log[-3000:]
    finally:
        if worker.poll() is None:
            for child in psutil.Process(worker.pid).children(recursive=True):
                child.kill()
            worker.kill()
