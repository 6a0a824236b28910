"""`SequenceParallel`: run token-wise modules (norms, dropout) on sequence shards.

A module ``f`` that acts on each token independently, ``f(X)[b, t] = f(X[b, t])`` (LayerNorm,
RMSNorm, dropout, elementwise activations), commutes with a split of the sequence:
``f([X_1; ...; X_p]) = [f(X_1); ...; f(X_p)]`` with ``X_r`` the ``r``-th block of tokens
(``Shard(sequence_dim)``). Between a `RowwiseParallel` layer with ``output_layouts=Shard(1)``
(a reduce-scatter instead of an all-reduce) and a `ColwiseParallel` one with
``input_layouts=Shard(1)`` (an all-gather), each rank then stores and normalizes only
``1/p`` of the activations, for the same communicated bytes as the all-reduce it replaces.

Parameters (norm gains and biases) become ``Replicate`` DTensors. Their gradient on rank
``r`` sums over its own tokens only, ``dg = sum_r dg_r``; the parameter hook of
`distribute_params` all-reduces it (one all-reduce per parameter per backward). The
forward needs no collective. Dropout draws from DTensor's random-number tracker, so its masks
are consistent across ranks but not bitwise those of a single-device run.
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
