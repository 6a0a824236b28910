"""The tensor-parallel face of ``shardwise.composable``: ``parallelize_module``, the styles, the
registry of module rules, ``loss_parallel``. See docs/tensor_parallel.md.

    from shardwise.composable.tp import ColwiseParallel, RowwiseParallel, parallelize_module
"""

from ._tp import (DEFAULT_REGISTRY, ApplyContext, ColwiseParallel, LayoutsMismatchError, ModuleParallel, ModuleRule,
                  NoMeshError, ParallelStyle, PlanError, PlanTypeError, PlanWarning, PrepareModuleInput,
                  PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel, SequenceParallel, TPRegistry,
                  UnsupportedModuleTypeError, local_shard_range, loss_parallel, parallelize_module, to_local_share,
                  vocab_parallel_cross_entropy)

__all__ = [
    "parallelize_module", "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "ModuleParallel",
    "ModuleRule", "TPRegistry", "DEFAULT_REGISTRY", "ApplyContext",
    "PlanError", "PlanTypeError", "PlanWarning", "NoMeshError", "UnsupportedModuleTypeError", "LayoutsMismatchError",
    "loss_parallel", "vocab_parallel_cross_entropy", "local_shard_range", "to_local_share",
]
