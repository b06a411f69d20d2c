"""loadtests/lib/stats.py's seed helpers and loadtests/sim_pd_itl.py: medians over seeds, P/D over aggregated ratios."""

from __future__ import annotations

import math

import pytest

from loadtests import sim_pd_itl
from loadtests.lib.stats import median_finite, median_over, quantile_points, ratio, share_above


def test_median_over_leaves_out_missing_and_nan() -> None:
    runs = [{"a": 1.0, "b": math.nan}, {"a": 3.0, "b": None}, {"a": 2.0, "b": 5, "c": True}]
    out = median_over(runs, ["a", "b", "c", "missing"])
    assert out["a"] == 2.0 and out["b"] == 5.0
    assert math.isnan(out["c"]) and math.isnan(out["missing"])  # booleans are not figures
    assert median_finite([4.0, 1.0, None, math.inf]) == 2.5


def test_ratio_is_nan_when_undefined() -> None:
    assert ratio(6.0, 10.0) == pytest.approx(0.6)
    for numerator, denominator in ((1.0, 0.0), (None, 1.0), (1.0, math.nan), (math.inf, 2.0)):
        assert math.isnan(ratio(numerator, denominator))


def test_share_above_and_quantile_points() -> None:
    gaps = [7.0] * 95 + [600.0] * 5  # 5% of gaps stalled: p90 is still a decode-only gap
    assert share_above(gaps, 14.0) == pytest.approx(0.05)
    assert math.isnan(share_above([], 1.0))
    p50, p90, p99 = quantile_points(gaps, [50, 90, 99])
    assert p50 == p90 == 7.0 and p99 == 600.0


def test_compare_gives_ratios_of_medians_and_per_seed() -> None:
    def run(seed: int, itl: float, tpot: float, ttft: float) -> dict:
        return {"seed": seed, "itl_p90_ms": itl, "tpot_p90_ms": tpot, "ttft_p90_ms": ttft, "itl_p50_ms": 7.0,
                "tpot_p50_ms": tpot, "ttft_p50_ms": ttft, "output_tok_s_per_gpu": 100.0,
                "cdf": {"itl_gap_ms": [7.0] * len(sim_pd_itl.CDF_QS)}}

    configs = {"aggregated 8": sim_pd_itl.combine([run(1, 7.4, 12.0, 700.0), run(2, 7.6, 13.0, 800.0),
                                                   run(3, 7.5, 14.0, 750.0)]),
               "P/D 3:5": sim_pd_itl.combine([run(1, 7.4, 7.2, 1400.0), run(2, 7.5, 7.8, 1200.0),
                                              run(3, 7.5, 7.4, 1500.0)])}
    assert configs["aggregated 8"]["median"]["tpot_p90_ms"] == 13.0
    assert "cdf" not in configs["P/D 3:5"]["runs"][0] and len(configs["P/D 3:5"]["cdf"]["itl_gap_ms"]) == 26
    ratios = sim_pd_itl.compare(configs)
    assert list(ratios) == ["P/D 3:5"]
    r = ratios["P/D 3:5"]
    assert r["tpot_p90_ms"] == pytest.approx(7.4 / 13.0) and r["ttft_p90_ms"] == pytest.approx(1400.0 / 750.0)
    assert r["itl_p90_ms"] == pytest.approx(1.0)
    assert r["tpot_p90_ms_per_seed"] == pytest.approx([7.2 / 12.0, 7.8 / 13.0, 7.4 / 14.0])


def test_run_reports_both_itls_and_the_handoff() -> None:
    setup = sim_pd_itl.Setup(warmup_s=10, measure_s=30, scale=0.02)
    aggregated = sim_pd_itl.run_agents(setup, "agg", 4, 1, num_workers=2)
    split = sim_pd_itl.run_agents(setup, "pd", 4, 1, num_prefill=1, num_workers=1)
    for run in (aggregated, split):
        assert run["errors"] == 0 and run["measured"] > 0 and run["seed"] == 1
        assert run["tpot_p90_ms"] > 0 and run["itl_p90_ms"] > 0 and len(run["cdf"]["itl_request_ms"]) == 26
    assert math.isnan(aggregated["handoff_p50_ms"])  # no hand-off without a prefill pool
    assert split["handoff_p50_ms"] > 0 and split["num_gpus"] == 2
