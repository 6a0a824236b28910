"""Synthetic next-token data that a tiny model learns within a few dozen steps.

Sequences are walks on a fixed random first-order Markov chain over the
vocabulary: every token has ``branching`` allowed successors, each taken with
probability ``1 / branching``. The chain is drawn once from ``seed``; the walks
of step ``s`` are drawn from ``seed`` and ``s``. So every rank that asks for the
same ``(step, seed)`` gets the same global batch, and each data-parallel rank
then takes its own contiguous slice of it with :func:`local_slice`.

A model that has learned the chain reaches a cross-entropy of
``ln(branching)`` (:func:`loss_floor`); an untrained one sits near
``ln(vocab)``. Inputs are ``tokens[:, :-1]`` and targets ``tokens[:, 1:]``
(:func:`inputs_and_targets`).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

__all__ = ["DEFAULT_BRANCHING", "successor_table", "global_batch", "local_slice", "inputs_and_targets", "loss_floor"]

DEFAULT_BRANCHING = 4

# Keeps the chain's stream apart from the per-step streams (which use seed and step).
_CHAIN_SALT = 0x5EED_C4A1


@lru_cache(maxsize=16)
def _successor_table_cached(vocab: int, seed: int, branching: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + _CHAIN_SALT)
    # Distinct successors per token: the first `branching` entries of a random permutation.
    return torch.rand(vocab, vocab, generator=g).argsort(dim=1)[:, :branching].contiguous()


def successor_table(vocab: int, seed: int, branching: int = DEFAULT_BRANCHING) -> torch.Tensor:
    """The chain: ``table[a]`` is the ``[branching]`` int64 tensor of tokens that may follow ``a``."""
    if not 1 <= branching <= vocab:
        raise ValueError(f"branching={branching} must be in [1, vocab={vocab}]")
    return _successor_table_cached(vocab, seed, branching).clone()


def global_batch(
    step: int, batch_size: int, seq_len: int, vocab: int, seed: int, branching: int = DEFAULT_BRANCHING
) -> torch.Tensor:
    """The whole batch of ``step``: int64 tokens ``[batch_size, seq_len + 1]`` on the CPU.

    Deterministic in its arguments, so all ranks compute the same tensor.
    The first token of each row is uniform; each next token is a uniformly
    chosen successor of the previous one in :func:`successor_table`.
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError("batch_size and seq_len must be positive")
    table = _successor_table_cached(vocab, seed, branching)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (batch_size,), generator=g)
    choice = torch.randint(branching, (batch_size, seq_len), generator=g)
    for t in range(seq_len):
        tokens[:, t + 1] = table[tokens[:, t], choice[:, t]]
    return tokens


def local_slice(batch: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """Rows ``[dp_rank * b, (dp_rank + 1) * b)`` of ``batch``, with ``b = len(batch) // dp_size``.

    The global batch size must be a multiple of ``dp_size`` so that every rank
    gets as many rows and the mean of the per-rank losses is the global mean.
    """
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    n = batch.shape[0]
    if n % dp_size:
        raise ValueError(f"global batch size {n} is not divisible by the data-parallel size {dp_size}")
    per_rank = n // dp_size
    return batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]


def inputs_and_targets(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens[:, :-1], tokens[:, 1:])``: predict each next token."""
    return tokens[:, :-1], tokens[:, 1:]


def loss_floor(branching: int = DEFAULT_BRANCHING) -> float:
    """The lowest expected cross-entropy on this data: ``ln(branching)`` nats.

    (The first prediction of each row cannot beat it either, as its token's
    successors are still uniform among ``branching``.)
    """
    return math.log(branching)
