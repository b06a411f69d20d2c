"""loadtests/lib/mesh_overhead_report.py: medians over rounds of per-round differences, and tracing's cost as a
per-round ratio of the traced edges' CPU to the plain ones'."""

from __future__ import annotations

from loadtests.lib.mesh_overhead_report import summary


def _path(ttft_p50: float, itl_p99: float, cpu: dict[str, float] | None = None) -> dict:
    return {"ttft": {"p50_ms": ttft_p50, "p99_ms": ttft_p50 * 2}, "itl": {"p50_ms": itl_p99 / 2, "p99_ms": itl_p99},
            "cpu_ms_per_request": cpu or {}}


def test_overheads_are_medians_of_per_round_differences_and_tracing_a_per_round_ratio():
    rounds = [
        {"direct": _path(20.0, 6.0), "edge": _path(23.0, 6.5, {"edge-0": 0.4, "edge-1": 0.2, "router-0": 0.1}),
         "edge_traced": _path(23.5, 6.6, {"edge-0": 0.33, "edge-1": 0.33, "router-0": 0.12})},
        {"direct": _path(30.0, 6.0), "edge": _path(31.0, 7.0, {"edge-0": 0.3, "edge-1": 0.3, "router-0": 0.1}),
         "edge_traced": _path(32.0, 7.5, {"edge-0": 0.35, "edge-1": 0.31, "router-0": 0.1})},
        {"direct": _path(25.0, 6.0), "edge": _path(27.0, 6.2, {"edge-0": 0.5, "edge-1": 0.1, "router-0": 0.1}),
         "edge_traced": _path(27.0, 6.4, {"edge-0": 0.6, "edge-1": 0.12, "router-0": 0.1})},
    ]
    entry = summary(16, 200, rounds, ["edge", "edge_traced"])
    assert entry["edge_ttft_overhead_p50_ms"] == 2.0  # per round 3, 1, 2: not median(edge) - median(direct)
    assert entry["edge_itl_overhead_p99_ms"] == 0.5  # 0.5, 1.0, 0.2
    assert entry["edge_edges_cpu_ms_per_request"] == 0.6  # edge-0 + edge-1, the router not counted
    assert round(entry["tracing_edge_cpu_ratio"], 6) == 1.1  # 0.66/0.6, 0.66/0.6, 0.72/0.6
    assert entry["tracing_ttft_added_p50_ms"] == 0.5  # 0.5, 1.0, 0.0
    assert entry["edge_cpu_ms_per_request"]["router-0"] == 0.1


def test_span_durations_are_grouped_by_service_and_name_after_the_start_longest_first():
    from loadtests.ttft_breakdown import durations_by_span
    from tests.otlp_receiver import ReceivedSpan

    def span(service: str, name: str, start_ms: float, ms: float) -> ReceivedSpan:
        start = int(start_ms * 1e6)
        return ReceivedSpan(service, name, "t", "s", "", 1, start, start + int(ms * 1e6), {}, (), 0)

    spans = [span("edge", "chat", 0, 99.0),  # before the measured window: left out
             span("edge", "chat", 10, 50.0), span("edge", "chat", 11, 70.0), span("edge", "chat", 12, 60.0),
             span("admission", "admission.decide", 10, 0.5)]
    rows = durations_by_span(spans, since_ns=int(10 * 1e6))
    assert [(r["service"], r["span"], r["n"]) for r in rows] == [("edge", "chat", 3),
                                                                  ("admission", "admission.decide", 1)]
    assert rows[0]["p50_ms"] == 60.0 and rows[1]["p90_ms"] == 0.5
