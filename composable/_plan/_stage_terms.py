"""The terms of a pipeline stage's plan that depend on where it sits and when (pure, shapes only):
the head's and embedding's activations, the activations alive before and after the rank's
first backward, and the gradients a stage holds at once. See [Note: the memory of a pipeline
stage] in ``_pipeline.py``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from .._pipeline import Action, walk_in_flight

__all__ = ["EndTerms", "end_terms", "before_and_after_first_backward", "held_grads"]


@dataclass(frozen=True)
class EndTerms:
    """Bytes on the whole batch of ``tokens`` tokens: ``head_kept`` (what the head and loss keep
    for backward: the log-softmax and the final norm's tensors), ``head_transient`` (the logits,
    or their gradient: alive for one microbatch at a time) and ``embedding`` (its output)."""

    head_kept: int = 0
    head_transient: int = 0
    embedding: int = 0

    @property
    def total(self) -> int:
        return self.head_kept + self.head_transient + self.embedding


def _last(modules: Sequence[nn.Module], kind: type) -> Any:
    found = [m for top in modules for m in top.modules() if isinstance(m, kind)]
    return found[-1] if found else None


def end_terms(pre: Sequence[nn.Module], post: Sequence[nn.Module], tokens: int | None,
              param_dtype=None, tp: int = 1) -> EndTerms:
    """The head's and embedding's activations on ``tokens`` tokens from their shapes: with the
    projection ``D -> V`` (the last ``nn.Linear`` after the blocks) ``head_kept = tokens (V + 2D)``
    and ``head_transient = tokens V`` elements; ``embedding = tokens E`` (the last ``nn.Embedding``
    before them, width ``E``); in ``param_dtype`` or the weight's dtype, divided by ``tp``.
    None or no such module: 0."""
    if tokens is None:
        return EndTerms()
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"plan_memory: tokens={tokens!r}; it is the tokens per data-parallel rank per step "
                         "(batch x sequence length) activation_bytes was measured on, an int >= 1, or None")
    head, emb = _last(post, nn.Linear), _last(pre, nn.Embedding)

    def size(m, elems):
        return -(-tokens * elems * (param_dtype or m.weight.dtype).itemsize // tp)

    kept = size(head, head.out_features + 2 * head.in_features) if head is not None else 0
    transient = size(head, head.out_features) if head is not None else 0
    return EndTerms(kept, transient, size(emb, emb.embedding_dim) if emb is not None else 0)


def before_and_after_first_backward(actions: Sequence[Action], weights: dict[int, float],
                                    kept_grads: float) -> tuple[float, float]:
    """A rank's peak weighted activations (`walk_in_flight`'s) before its first backward that
    gives parameter gradients (``B``, or ``W``), and from that backward on (0 if none)."""
    halves = [h for a in actions for h in a.halves]
    first = next((i for i, h in enumerate(halves) if h.kind.frees_activations), len(halves))
    before = walk_in_flight(halves[:first], weights, kept_grads)[0]
    if first == len(halves):
        return before, 0.0
    done = halves[first]
    # what is alive after it, in a monotone prefix (only F and I come before the first B / W), then the rest
    alive = [h for h in halves[:first] if (h.stage, h.microbatch) != (done.stage, done.microbatch)]
    return before, walk_in_flight(alive + halves[first + 1:], weights, kept_grads)[0]


def held_grads(plan) -> int:
    """Gradient bytes a stage holds at once in a backward after its first, beyond
    ``root_grads`` and ``accumulated_grads``: the largest unit's summed gradients and at most one
    unit's new ones, in a full backward and in a split backward's ``W`` alike ([Note: weight
    gradients in bounded batches] in ``_pipeline/_split/_split_backward.py``)."""
    root, others = plan.units[-1], plan.units[:-1]
    largest = max(others, key=lambda u: u.unsharded, default=root)
    summed = largest.unsharded_grads if largest is not root else 0
    return summed + max(u.unsharded_grads for u in plan.units)
