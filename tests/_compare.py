"""Numeric comparison that a NaN cannot pass.

Python's ``max`` compares with ``>``, which is false against a NaN: ``max(0.0, nan)`` is ``0.0``
and ``max([0.1, nan])`` is ``0.1``, so a worst error folded with ``max`` (or a filter
``v > tol``) lets a NaN through as if it were small. Every error the suite folds goes through
`maxerr`, and every relative error of tensors through `rel_err`, which is ``inf`` for a
non-finite value on either side.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def maxerr(*values: Any) -> float:
    """The largest of ``values`` (numbers, or one iterable of numbers or 0-d tensors), ``inf``
    when any is NaN. Errors are not negative: the result is at least 0. Nothing to compare is
    an error (``ValueError``, as for ``max``), not a pass."""
    items: list[Any] = list(values)
    if len(values) == 1 and hasattr(values[0], "dim"):  # a tensor: its elements
        items = values[0].detach().reshape(-1).tolist()
    elif len(values) == 1 and isinstance(values[0], Iterable):
        items = list(values[0])
    if not items:
        raise ValueError("maxerr() of no values: nothing was compared")
    out = 0.0
    for v in items:
        v = float(v)
        if math.isnan(v):
            return math.inf
        out = max(out, v)
    return out


def rel_err(a: Any, b: Any, floor: float = 1e-12) -> float:
    """``max |a - b| / max |b|`` over two tensors (``b``'s magnitude floored at ``floor``),
    ``inf`` when either holds a non-finite value."""
    import torch

    a, b = a.detach().double(), b.detach().double()
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return math.inf
    if b.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp_min(floor)).item()


def rel_errs(got: Iterable[float], want: Iterable[float]) -> float:
    """The worst ``|g - w| / |w|`` over paired numbers (losses), ``inf`` when the lengths differ or
    any value is not finite."""
    got, want = list(got), list(want)
    if len(got) != len(want) or not all(math.isfinite(x) for x in got + want):
        return math.inf
    return maxerr(abs(g - w) / abs(w) if w else abs(g) for g, w in zip(got, want))
