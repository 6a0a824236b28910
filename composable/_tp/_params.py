"""Turning a module's parameters into DTensors on the tensor-parallel mesh.

Each parameter (submodules included) becomes ``nn.Parameter(DTensor)`` with one placement on the
1-D mesh, registered in place of the original; ``full_tensor()`` is the single-device parameter.
Values come from ``distribute_tensor(..., src_data_rank=s)``: ``s = 0`` (default, as torch)
sends rank 0's copy so ranks agree; ``s = None`` slices each rank's own copy without
communicating.

Gradients keep the parameter's placement: a replicated parameter meeting sharded activations (a
norm under `SequenceParallel`) gets a ``Partial`` gradient, which a hook all-reduces before it is
accumulated, so ``p.grad.placements == p.placements`` always holds.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, distribute_tensor

__all__ = ["distribute_params", "check_not_distributed", "GradToParamLayout"]


class GradToParamLayout:
    """Parameter hook: redistribute a DTensor gradient to the parameter's placements."""

    def __init__(self, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> None:
        self.mesh = mesh
        self.placements = placements

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor) and tuple(grad.placements) != self.placements:
            return grad.redistribute(self.mesh, self.placements)
        return grad

    def __repr__(self) -> str:
        return f"GradToParamLayout({self.placements})"


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def check_not_distributed(module: nn.Module, what: str) -> None:
    """Raise if any parameter of ``module`` is already a DTensor (parallelized twice)."""
    done = [n for n, p in module.named_parameters() if isinstance(p, DTensor)]
    if done:
        raise ValueError(f"{what}: parameter(s) {done} are already DTensors (was the module "
                         "parallelized twice, or by torch's parallelize_module?)")


def distribute_params(module: nn.Module, mesh: DeviceMesh, placements: Mapping[str, Placement],
                      *, src_data_rank: int | None, what: str) -> None:
    """Replace every parameter of ``module`` by a DTensor with ``placements[name]``.

    Names in ``placements`` that the module lacks (a Linear without bias) are skipped. A
    parameter without an entry, or one that is already a DTensor, is an error naming it
    (``what`` says which style and module, for the message).
    """
    params = dict(module.named_parameters())
    unknown = [n for n in params if n not in placements]
    if unknown:
        raise ValueError(f"{what}: no placement for parameter(s) {unknown}; the rule covers "
                         f"{sorted(placements)}. Register a rule that names every parameter")
    check_not_distributed(module, what)
    for name, param in params.items():
        placement = placements[name]
        if isinstance(placement, type):
            raise TypeError(f"{what}: placement for {name!r} is the class {placement.__name__}; "
                            f"use an instance such as {placement.__name__}()")
        dt = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=src_data_rank)
        new = nn.Parameter(dt, requires_grad=param.requires_grad)
        if new.requires_grad:
            new.register_hook(GradToParamLayout(mesh, tuple(dt.placements)))
        owner, leaf = _owner(module, name)
        owner.register_parameter(leaf, new)
