"""The mesh overhead benchmark (loadtests/mesh_overhead.py), tiny: both meshes (plain and traced) started as
``infermesh up`` starts them, one round at 2 streams; every request answered, both paths measured, the traced
mesh exported spans, and the report and its picture written. It keeps the benchmark working when the request
path changes (its last version's warm-up swallowed the 503s of an edge waiting for an admission it never ran)."""

from __future__ import annotations

import json

import pytest

from loadtests import mesh_overhead

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_tiny_mesh_overhead_run_measures_both_paths_and_both_meshes(tmp_path):
    report = mesh_overhead.main(["--tracing", "both", "--concurrency", "2", "--rounds", "1", "--requests", "6",
                                 "--out", str(tmp_path / "mo")])

    assert report["failures"] == 0 and report["otlp_exports"]["requests"] > 0
    (entry,) = report["results"]
    (one,) = entry["rounds"]
    for path in ("direct", "edge", "edge_traced"):
        assert one[path]["ttft"]["n"] == 6 and one[path]["itl"]["n"] > 0, path
    names = set(one["edge"]["cpu_ms_per_request"])
    assert {"nats", "admission-0", "admission-1", "breaker", "metering", "batch", "worker-0", "edge-0"} <= names
    assert entry["edge_ttft_p50_ms"] > 0 and entry["direct_ttft_p50_ms"] > 0
    assert entry["tracing_edge_cpu_ratio"] > 0
    assert json.loads((tmp_path / "mo.json").read_text())["command"].startswith("python -m loadtests.mesh_overhead")
    assert (tmp_path / "mo.png").stat().st_size > 0
