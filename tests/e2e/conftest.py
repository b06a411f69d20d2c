"""Fixtures the end-to-end tests share."""

from __future__ import annotations

import re

import pytest

from tests.e2e.mesh_process import UpProcess
from tests.e2e.test_metering_mesh import start_mesh
from tests.utils import eventually


@pytest.fixture
async def batch_mesh(nats_url, namespace, tiny_model, ledger_url):
    """The metering mesh (one sim worker, an edge, the ledger at ``ledger_url``) with a batch service leading."""
    mesh = await start_mesh(nats_url, namespace, tiny_model, ledger_url)
    batch = await mesh.start_batch(database_url=ledger_url, tick_s=0.05, retry_s=0.1)
    await eventually(lambda: batch.leadership.is_leader, 10)
    yield mesh
    await mesh.stop()


NOTABLE = re.compile(r"WARNING|ERROR|CRITICAL|Traceback|steps down|left the mesh")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """A failed test that ran on ``infermesh up`` shows what the mesh logged: its warnings and errors, and its last
    lines (a CI run keeps nothing else of the mesh's processes)."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for name, value in getattr(item, "funcargs", {}).items():
        up = value.get("up") if isinstance(value, dict) else value
        if isinstance(up, UpProcess):
            lines = list(up.lines)
            notable = [line for line in lines if NOTABLE.search(line)][-150:]
            report.sections.append((f"infermesh up ({name}): warnings and errors", "".join(notable)))
            report.sections.append((f"infermesh up ({name}): last lines", "".join(lines[-40:])))
