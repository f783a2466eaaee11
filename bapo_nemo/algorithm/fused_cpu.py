"""The bound search's token pass as one fused numba loop, for CPU tensors.

Eager `bapo._token_statistics` makes ~15 memory-bound passes over the tokens; this loop reads each token
once and yields the same numbers (histograms bit for bit, the sums of r and log r to rounding), held to
the eager version by tests/unit/test_algorithm_fused_cpu.py. Used for CPU tensors when numba is
importable (BAPO_FUSED_CPU=0 opts out); everything else takes the eager path.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; the eager path covers its absence
    numba = None


_enabled = os.environ.get("BAPO_FUSED_CPU", "1") != "0"


def available() -> bool:
    """True when CPU tensors take the fused loop (numba importable and BAPO_FUSED_CPU is not 0)."""
    return numba is not None and _enabled


@contextlib.contextmanager
def disabled():
    """Run the PyTorch path on CPU too (benchmarks and debugging)."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


if numba is not None:

    @numba.njit(cache=True, nogil=True)
    def _kernel(r, bits, a, mask, w, use_w, log_ratio, use_log_ratio,
                shift, first, last, below, inside, u, with_abs_a, hist, totals):
        """r, bits (r's bit pattern), a, mask, w, log_ratio: 2-D views of one shape (zero strides allowed).
        hist: float64 [3, 3u + 1]; totals: float64 [2] (sum r with masked tokens as 1, sum log r)."""
        masked_bin = 3 * u
        sum_r = 0.0
        sum_log = 0.0
        for i in range(r.shape[0]):
            for j in range(r.shape[1]):
                if mask[i, j] <= 0:  # a NaN mask counts as kept, as with `mask <= 0` in the eager path
                    hist[0, masked_bin] += 1.0
                    sum_r += 1.0
                    continue
                cell = min(max(bits[i, j] >> shift, first), last) - first
                b = below[cell] + (1 if bits[i, j] > inside[cell] else 0)
                av = a[i, j]
                code = b if av > 0 else (b + u if av < 0 else b + 2 * u)
                abs_a = abs(av) * w[i, j] if use_w else abs(av)
                rv = r[i, j]
                hist[0, code] += 1.0
                hist[1, code] += rv * abs_a  # product in the ratios' dtype, as `r * abs_a` in torch
                if with_abs_a:
                    hist[2, code] += abs_a
                sum_r += rv
                if use_log_ratio:
                    sum_log += log_ratio[i, j]
                else:
                    log_r = math.log(rv)  # -inf for r = 0, NaN for NaN
                    sum_log += -100.0 if log_r < -100.0 else log_r  # noqa: FURB136 -- not max(): NaN must stay NaN
        totals[0] += sum_r
        totals[1] += sum_log


def _as_2d(t: torch.Tensor, shape: torch.Size):
    """A numpy view of `t` broadcast to `shape`, folded to 2-D without copying when possible."""
    t = t.expand(shape)
    return (t.reshape(1, -1) if len(shape) <= 1 else t.reshape(-1, shape[-1])).numpy()


def token_statistics(ratio, advantages, mask, weights, log_ratio, int_dtype, tables, n_bins_per_sign,
                     with_abs_a, hist: torch.Tensor, totals: torch.Tensor) -> None:
    """Fill `bapo._token_statistics`' float64 buffers: `hist` [3, 3u + 1] and `totals` [2], zeroed."""
    shift, first, last, below, inside = tables
    shape = ratio.shape
    r = ratio.contiguous()
    one = torch.ones((), dtype=r.dtype)
    _kernel(
        _as_2d(r, shape), _as_2d(r.view(int_dtype), shape), _as_2d(advantages, shape), _as_2d(mask, shape),
        _as_2d(one if weights is None else weights, shape), weights is not None,
        _as_2d(one if log_ratio is None else log_ratio, shape), log_ratio is not None,
        shift, first, last, below.numpy(), inside.numpy(), n_bins_per_sign, with_abs_a, hist.numpy(),
        totals.numpy(),
    )
