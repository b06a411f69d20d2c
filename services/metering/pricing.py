"""Which price applies to a usage event: the model's row with the latest ``effective_from`` at or before it.

Pure: metering loads every price row into a PriceBook and reloads it when prices change; a usage
event is priced at the moment its request arrived, so a price change never reprices old traffic. A line of a
batch job (``UsageEvent.batch_id`` set) pays the model's batch price: ``batch_percent`` (default 50) of each part.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from shared.schema import ModelPrice, PriceSheet


class PriceBook:
    def __init__(self, rows: Iterable[tuple[str, float, ModelPrice]] = ()) -> None:
        """``rows``: (model, effective_from as unix seconds, price)."""
        self._starts: dict[str, list[float]] = {}
        self._prices: dict[str, list[ModelPrice]] = {}
        for model, start, price in sorted(rows, key=lambda row: (row[0], row[1])):
            self._starts.setdefault(model, []).append(start)
            self._prices.setdefault(model, []).append(price)

    def price(self, model: str, at: float) -> ModelPrice | None:
        """The price in effect at ``at`` (None: the model had no price then, so it is free)."""
        starts = self._starts.get(model)
        if not starts:
            return None
        index = bisect.bisect_right(starts, at) - 1
        return self._prices[model][index] if index >= 0 else None

    def cost_nano(self, model: str, at: float, prompt: int, cached: int, completion: int,
                  batch: bool = False) -> int:
        """``batch``: a line of a batch job, at the model's batch price (``ModelPrice.batch_percent``)."""
        price = self.price(model, at)
        return price.cost_nano(prompt, cached, completion, batch) if price else 0

    def savings_nano(self, model: str, at: float, cached: int, batch: bool = False) -> int:
        """What the cached tokens did not cost, compared with the full input price (a batch line's at its price)."""
        price = self.price(model, at)
        if price is None:
            return 0
        pico = cached * (price.input_micros - price.cached_input_micros)
        if batch:
            return (pico * price.batch_percent + 50_000) // 100_000
        return (pico + 500) // 1000

    def sheet(self, at: float) -> PriceSheet:
        """The prices in effect at ``at``, for admission's worst-case reservations."""
        prices = {}
        for model in self._starts:
            price = self.price(model, at)
            if price is not None:
                prices[model] = price
        return PriceSheet(prices, at)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PriceBook) and (self._starts, self._prices) == (other._starts, other._prices)
