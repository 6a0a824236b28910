"""`SequenceParallel`: run token-wise modules (norms, dropout) on sequence shards.

A module acting on each token independently (LayerNorm, RMSNorm, dropout, elementwise
activations) commutes with a split of the sequence (``Shard(sequence_dim)``). Between a
`RowwiseParallel` with ``output_layouts=Shard(1)`` (a reduce-scatter) and a `ColwiseParallel`
with ``input_layouts=Shard(1)`` (an all-gather), each rank stores and normalizes ``1/p`` of the
activations for the bytes of the all-reduce it replaces.

Parameters become ``Replicate`` DTensors; their partial gradients are all-reduced by the hook
of `distribute_params`. The forward needs no collective. Dropout uses DTensor's random-number
tracker: masks consistent across ranks, not bitwise a single-device run's.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._layouts import to_layout
from ._params import check_not_distributed, distribute_params
from ._styles import ApplyContext, ParallelStyle

__all__ = ["SequenceParallel"]


@dataclass(frozen=True, kw_only=True)
class SequenceParallel(ParallelStyle):
    """Shard a token-wise module's input and output along the sequence dimension.

    Input 0: a plain tensor is this rank's block of the sequence, all blocks of one length
    as in torch (``uneven_shards=True``: ``torch.chunk`` blocks of any lengths, found by one
    small all-gather of lengths per call; a DTensor input, e.g. ``use_local_output=False``
    upstream, carries its length and needs neither); a DTensor in another layout is
    redistributed to ``Shard(sequence_dim)`` (from ``Replicate``: no communication, from
    ``Partial``: a reduce-scatter). The module's own forward runs on DTensors.

    Args:
        sequence_dim: the sequence dimension of input 0 (default 1, ``[B, T, D]``).
        use_local_output: return the local tensor instead of the DTensor (default False,
            as in torch: the next module usually wants the DTensor).
        uneven_shards: plain inputs may be uneven ``torch.chunk`` blocks (see above); not a
            torch argument.
    """

    sequence_dim: int = 1
    use_local_output: bool = False
    uneven_shards: bool = False

    def validate(self, module: nn.Module, ctx: ApplyContext) -> None:
        check_not_distributed(module, ctx.where(self, module))

    def apply(self, module: nn.Module, mesh: DeviceMesh, ctx: ApplyContext) -> None:
        where = ctx.where(self, module)
        distribute_params(module, mesh, {n: Replicate() for n, _ in module.named_parameters()},
                          src_data_rank=ctx.src_data_rank, what=where)
        layout = Shard(self.sequence_dim)

        def shard_input(mod: nn.Module, args: tuple) -> tuple:
            if not args:
                raise TypeError(f"{where}: called without positional input; the sequence-sharded "
                                "tensor must be the first positional argument")
            return (to_layout(args[0], mesh, layout, layout, uneven=self.uneven_shards), *args[1:])

        def output(mod: nn.Module, args: tuple, out):
            if self.use_local_output and isinstance(out, DTensor):
                return out.to_local()
            return out

        module.register_forward_pre_hook(shard_input)
        module.register_forward_hook(output)
