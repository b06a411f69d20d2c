"""A mesh (router + one worker + edges, no admission) per engine: the sim engine, and the vLLM CPU engine on the
tiny random-weight model (marked vllm and slow; started only when a test selecting it runs). Every tool-call
format the edge offers is a dimension of ``tool_mesh``: the one mesh of an engine has an edge per (format,
closing on/off), so a test runs once per (engine, format) and a vLLM engine starts once."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import openai
import pytest
import pytest_asyncio

from infermesh.local import LocalMesh
from services.edge.tools import TOOL_FORMATS
from tests.utils import eventually

MODEL = "tiny"
ENGINES = [pytest.param("sim", id="sim"),
           pytest.param("vllm", id="vllm", marks=[pytest.mark.vllm, pytest.mark.slow])]
FORMATS = list(TOOL_FORMATS)  # hermes, glm: the same bar for each
CLOSINGS = (128, 0)  # tool_close_within of the two edges of a format


@dataclass
class Mesh:
    engine: str
    fmt: str  # the tool-call format of both clients' edges (tool_call_format)
    mesh: LocalMesh
    client: openai.AsyncOpenAI  # the edge with budget-aware closing (tool_close_within 128, the default)
    client_off: openai.AsyncOpenAI  # an edge with it off (tool_close_within 0)
    model: str = MODEL

    @property
    def seeds(self) -> range:
        """Seeds per check: the vLLM engine on one core is much slower than the sim."""
        return range(6) if self.engine == "sim" else range(2)

    @property
    def base_url(self) -> str:
        return str(self.client.base_url)

    @property
    def key(self) -> str:
        return self.mesh.dev_key


async def start_tool_mesh(nats_url: str, engine: str, model_path: str, close_within: tuple[int, ...] = (128,),
                          max_model_len: int = 8192, formats: tuple[str, ...] = ("hermes",)) -> LocalMesh:
    """Router, one ``engine`` worker and one edge per (format, ``close_within`` value), in that order:
    edge ``i * len(close_within) + j`` writes ``formats[i]`` with tool_close_within ``close_within[j]``."""
    mesh = LocalMesh(nats_url, f"tc{uuid.uuid4().hex[:8]}")
    await mesh.start_router()
    if engine == "sim":
        await mesh.start_worker(worker_id="sim-0", engine="sim", model=MODEL, model_path=model_path,
                                max_model_len=max_model_len, block_size=16, num_kv_blocks=16384,
                                sim_ttft_ms=0.5, sim_itl_ms=0.0, heartbeat_ttl_s=60.0)
    else:
        await mesh.start_worker(worker_id="vllm-0", engine="vllm", model=MODEL, model_path=model_path,
                                max_model_len=min(max_model_len, 2048), cpu_core=0, heartbeat_ttl_s=60.0)
    for fmt in formats:
        for value in close_within:
            await mesh.start_edge(admission=False, tool_close_within=value, tool_call_format=fmt)
    for edge in mesh.edges:
        await eventually(edge.mesh.is_ready, 60)
    return mesh


# Justified skip: glm on the vLLM engine runs every test but test_schema_features (9 cases of many generations
# each; test_corpus_500_calls_all_valid already skips itself on vLLM): on one core it would double the suite's vLLM
# time. The corpus on vLLM in both formats: loadtests/tool_calls.py --engine vllm --format all.
GLM_ON_VLLM_SKIPPED = {"test_schema_features"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        ids = getattr(getattr(item, "callspec", None), "id", "")
        if item.originalname in GLM_ON_VLLM_SKIPPED and "vllm" in ids and "glm" in ids:  # type: ignore[attr-defined]
            item.add_marker(pytest.mark.skip(reason="glm on vLLM: the corpus runs in loadtests/tool_calls.py "
                                                    "--engine vllm --format all (docs/results/tool_calls)"))


@pytest_asyncio.fixture(scope="session", params=ENGINES, loop_scope="session")
async def engine_mesh(request: pytest.FixtureRequest, nats_url: str, tiny_model):
    """(engine, mesh, clients by (format, close_within)): one mesh per engine, every format's edges in it."""
    mesh = await start_tool_mesh(nats_url, request.param, str(tiny_model), close_within=CLOSINGS,
                                 formats=tuple(FORMATS))
    clients = {}
    for i, fmt in enumerate(FORMATS):
        for j, value in enumerate(CLOSINGS):
            clients[fmt, value] = openai.AsyncOpenAI(base_url=mesh.url_of(i * len(CLOSINGS) + j),
                                                     api_key=mesh.dev_key, max_retries=0, timeout=300)
    try:
        yield request.param, mesh, clients
    finally:
        for client in clients.values():
            await client.close()
        await mesh.stop()


@pytest_asyncio.fixture(scope="session", params=FORMATS, loop_scope="session")
async def tool_mesh(request: pytest.FixtureRequest, engine_mesh) -> Mesh:
    engine, mesh, clients = engine_mesh
    return Mesh(engine, request.param, mesh, clients[request.param, 128], clients[request.param, 0])
