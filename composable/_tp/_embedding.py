"""The vocabulary-parallel embedding: ``nn.Embedding`` split by vocabulary rows.

Rank ``r`` holds ``E_r = E[o_r : o_r + n_r]`` (``Shard(0)``, ``torch.chunk`` layout; a rank may
hold no row). For replicated token ids ``t``:

    Y_r[i] = E_r[t_i - o_r]   if o_r <= t_i < o_r + n_r,   else 0
    Y      = sum_r Y_r                                        (Partial)

Each row lives on one rank, so the sum is ``E[t]``; the style all-reduces ``Y`` or
reduce-scatters it over the sequence, and the backward needs no collective. ``padding_idx`` is
honoured; ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` are refused (they act per looked-up
row, which the masked lookups would disturb).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ._layouts import local_shard_range

__all__ = ["vocab_parallel_embedding", "check_vocab_parallel"]


def check_vocab_parallel(module: nn.Module) -> None:
    """Refuse the ``nn.Embedding`` options a vocabulary split cannot reproduce."""
    bad = [n for n in ("max_norm", "scale_grad_by_freq", "sparse") if getattr(module, n, None)]
    if bad:
        raise ValueError(f"RowwiseParallel (vocabulary-parallel) nn.Embedding does not support "
                         f"{', '.join(f'{n}={getattr(module, n)!r}' for n in bad)}; construct the "
                         "embedding without them or use ColwiseParallel (split of the embedding dim)")


def vocab_parallel_embedding(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """This rank's summand ``Y_r`` of ``module(ids)``; ``module.weight`` is ``Shard(0)``.

    The local forward of the ``(RowwiseParallel, nn.Embedding)`` rule; ``ids`` are this rank's
    (replicated) local token ids. Returns a plain tensor of shape ``[*ids.shape, dim]``.
    """
    weight = module.weight
    assert isinstance(weight, DTensor), "the (RowwiseParallel, nn.Embedding) rule makes weight a DTensor"
    start, stop = local_shard_range(weight, 0)
    local_w = weight.to_local()
    local_ids = ids - start
    outside = (local_ids < 0) | (local_ids >= stop - start)
    if stop == start:  # no rows here: a zero summand that still reaches (empty) weight grads
        return local_w.sum() * 0 + local_w.new_zeros((*ids.shape, local_w.shape[1]))
    pad = module.padding_idx
    if pad is not None:
        pad = pad % weight.shape[0] - start
        pad = pad if 0 <= pad < stop - start else None
    out = F.embedding(local_ids.masked_fill(outside, 0), local_w, padding_idx=pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)
