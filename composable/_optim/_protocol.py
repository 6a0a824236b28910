"""The protocol by which an optimizer says it needs whole matrices, and the split of a model's
parameters into the matrices it takes and the rest.

An optimizer class whose update reads a whole parameter at once (an orthogonalization, a
preconditioner) declares ``needs_whole_matrices = True`` or is registered with
`register_whole_matrix_optimizer`. Otherwise it is an ordinary ``torch.optim.Optimizer``
(in-place ``step()`` from ``p.grad``, ``self.state[p]``, ``param_groups``); `WholeMatrixOptimizer`
runs it on whole tensors on their owner. ``torch.optim.Muon`` is registered here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

__all__ = ["WHOLE_MATRIX_ATTR", "needs_whole_matrices", "register_whole_matrix_optimizer", "split_matrix_params"]

WHOLE_MATRIX_ATTR = "needs_whole_matrices"
_REGISTERED: list[type] = []


def register_whole_matrix_optimizer(cls: type) -> type:
    """Declare that ``cls`` (and its subclasses) needs whole matrices; returns ``cls`` (usable as a
    decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"register_whole_matrix_optimizer: {cls!r} is not a torch.optim.Optimizer subclass")
    if cls not in _REGISTERED:
        _REGISTERED.append(cls)
    return cls


def needs_whole_matrices(cls: type) -> bool:
    """Whether ``cls`` declares ``needs_whole_matrices = True`` or is (a subclass of) a registered
    class."""
    if not isinstance(cls, type):
        return False
    declared = getattr(cls, WHOLE_MATRIX_ATTR, None)
    if declared is not None:
        return declared is True
    return any(issubclass(cls, r) for r in _REGISTERED)


if hasattr(torch.optim, "Muon"):
    register_whole_matrix_optimizer(torch.optim.Muon)


def split_matrix_params(model: nn.Module, *, embeddings: bool = False,
                        skip: Iterable[nn.Module] = ()) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(matrices, others)`` of ``model``'s parameters that require grad, each once, in
    ``model.parameters()`` order: the 2-D weights for a whole-matrix optimizer, and the rest
    (norms, biases; embeddings unless ``embeddings=True``; the parameters of the modules in
    ``skip``, e.g. the output head) for an elementwise one such as AdamW."""
    held_out = {id(p) for m in skip for p in m.parameters()}
    if not embeddings:
        held_out |= {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    matrices: list[nn.Parameter] = []
    others: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (matrices if p.ndim == 2 and id(p) not in held_out else others).append(p)
    return matrices, others
