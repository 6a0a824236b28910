"""The bubble of the GPipe / 1F1B family (pure)."""

from __future__ import annotations

__all__ = ["one_f_one_b_bubble"]


def one_f_one_b_bubble(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """``(p - 1) / (v m + p - 1)``: idle fraction of a rank (backward twice the forward)."""
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)
