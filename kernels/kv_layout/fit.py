"""Least-squares fit of the sim's transfer model ``time = bytes / bandwidth + descriptors * overhead``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True, slots=True)
class TransferFit:
    overhead_s: float  # seconds per descriptor
    bandwidth_bytes_per_s: float
    rms_rel_err: float  # of the fitted times against the measured ones
    max_rel_err: float
    points: int

    def predict(self, nbytes: float, descriptors: float) -> float:
        return nbytes / self.bandwidth_bytes_per_s + descriptors * self.overhead_s

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def fit_transfer_model(nbytes: Sequence[float], descriptors: Sequence[float], seconds: Sequence[float],
                       relative: bool = True) -> TransferFit:
    """Fit (1 / bandwidth, overhead) with no intercept.

    ``relative`` weights each point by 1 / its time, so transfers of a few ms count as
    much as those of seconds (the residual minimised is the relative error).
    """
    b = np.asarray(nbytes, dtype=float)
    d = np.asarray(descriptors, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if not (b.size == d.size == t.size) or b.size < 2:
        raise ValueError("need at least two (bytes, descriptors, seconds) points of equal count")
    if (t <= 0).any():
        raise ValueError("times must be positive")
    a = np.column_stack([b, d])
    w = 1.0 / t if relative else np.ones_like(t)
    (inv_bw, overhead), *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    if inv_bw <= 0:
        raise ValueError(f"fit gave a non-positive 1/bandwidth ({inv_bw}); the points do not follow the model")
    rel = (a @ np.array([inv_bw, overhead]) - t) / t
    return TransferFit(float(overhead), float(1.0 / inv_bw), float(np.sqrt(np.mean(rel**2))),
                       float(np.abs(rel).max()), int(t.size))

