"""The example's optimizers: ``--optimizer adamw`` (AdamW over every parameter, the default) or
``--optimizer muon`` (torch.optim.Muon over the hidden 2-D weights, each updated whole by one owner
rank through shardwise's `WholeMatrixOptimizer`, and AdamW over the embeddings, the output head and
the norms: docs/optimizers.md)."""

from __future__ import annotations

import torch

from shardwise.composable.optim import WholeMatrixOptimizer, split_matrix_params

OPTIMIZERS = ("adamw", "muon")
MUON_LR = 0.02  # torch.optim.Muon's usual rate with adjust_lr_fn="original"


class Optimizers(tuple):
    """Several optimizers stepped together; checkpoints take them as they are (an iterable of
    optimizers is what ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` accept)."""

    def step(self) -> None:
        for o in self:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self:
            o.zero_grad(set_to_none=set_to_none)


def build_optimizer(model: torch.nn.Module, name: str, lr: float, muon_lr: float = MUON_LR):
    """``name``'s optimizer(s) over ``model`` (sharded already)."""
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr)
    if name != "muon":
        raise ValueError(f"--optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    head = [m for n, m in model.named_modules() if n == "output"]
    matrices, others = split_matrix_params(model, skip=head)
    return Optimizers((WholeMatrixOptimizer(torch.optim.Muon, matrices, lr=muon_lr, weight_decay=0.0),
                       torch.optim.AdamW(others, lr=lr)))
