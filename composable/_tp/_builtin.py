"""The built-in rules: ``nn.Linear`` and ``nn.Embedding`` under Colwise and Rowwise.

| style, module | parameters | input needed | output produced | forward |
| --- | --- | --- | --- | --- |
| Colwise, Linear | weight ``Shard(0)``, bias ``Shard(0)`` | ``Replicate`` | ``Shard(-1)`` | DTensor |
| Rowwise, Linear | weight ``Shard(1)``, bias ``Replicate`` | ``Shard(-1)`` (width ``in_features``) | ``Partial`` | DTensor |
| Colwise, Embedding | weight ``Shard(1)`` | ``Replicate`` | ``Shard(-1)`` | DTensor |
| Rowwise, Embedding | weight ``Shard(0)`` | ``Replicate`` | ``Partial`` | local, `vocab_parallel_embedding` |

``DEFAULT_REGISTRY`` is immutable; extend it with ``DEFAULT_REGISTRY.with_rule(...)``.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from ._embedding import check_vocab_parallel, vocab_parallel_embedding
from ._registry import ModuleRule, TPRegistry
from ._styles import ColwiseParallel, RowwiseParallel

__all__ = ["DEFAULT_REGISTRY", "LINEAR_COLWISE", "LINEAR_ROWWISE", "EMBEDDING_COLWISE",
           "EMBEDDING_ROWWISE"]


def _check_colwise_embedding(module: nn.Module) -> None:
    if getattr(module, "max_norm", None) is not None:
        raise ValueError(f"ColwiseParallel nn.Embedding does not support max_norm={module.max_norm!r}: "
                         "each rank would renormalize its slice of a row by the slice's norm; "
                         "construct the embedding without max_norm")


def _linear_in_width(module: nn.Module) -> tuple[int]:
    assert isinstance(module, nn.Linear)
    return (module.in_features,)


LINEAR_COLWISE = ModuleRule(
    params={"weight": Shard(0), "bias": Shard(0)},
    input_layouts=(Replicate(),), output_layout=Shard(-1),
    summary="Y_r = X W_r^T + b_r, W split by rows",
)
LINEAR_ROWWISE = ModuleRule(
    params={"weight": Shard(1), "bias": Replicate()},
    input_layouts=(Shard(-1),), output_layout=Partial(), input_sizes=_linear_in_width,
    summary="Y = sum_r X_r W_r^T + b, W split by columns",
)
EMBEDDING_COLWISE = ModuleRule(
    params={"weight": Shard(1)},
    input_layouts=(Replicate(),), output_layout=Shard(-1), check=_check_colwise_embedding,
    summary="Y_r = E_r[ids], E split by embedding columns",
)
EMBEDDING_ROWWISE = ModuleRule(
    params={"weight": Shard(0)},
    input_layouts=(Replicate(),), output_layout=Partial(),
    forward=vocab_parallel_embedding, check=check_vocab_parallel,
    summary="Y = sum_r mask_r(ids) E_r[ids - o_r], E split by vocabulary rows",
)

DEFAULT_REGISTRY = TPRegistry({
    (ColwiseParallel, nn.Linear): LINEAR_COLWISE,
    (RowwiseParallel, nn.Linear): LINEAR_ROWWISE,
    (ColwiseParallel, nn.Embedding): EMBEDDING_COLWISE,
    (RowwiseParallel, nn.Embedding): EMBEDDING_ROWWISE,
})
