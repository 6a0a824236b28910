"""Tensor parallelism on DTensor: ``parallelize_module``, the styles, ``loss_parallel``.

One file per concept; docs/architecture.md maps them and docs/tensor_parallel.md explains them.
"""

from ._builtin import DEFAULT_REGISTRY
from ._layouts import local_shard_range, to_local_share
from ._loss import loss_parallel, vocab_parallel_cross_entropy
from ._plan import NoMeshError, PlanError, PlanTypeError, PlanWarning, parallelize_module
from ._prepare import LayoutsMismatchError, PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput
from ._registry import ModuleRule, TPRegistry
from ._sequence import SequenceParallel
from ._styles import (ApplyContext, ColwiseParallel, ModuleParallel, ParallelStyle, RowwiseParallel,
                      UnsupportedModuleTypeError)

__all__ = ["parallelize_module", "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "ModuleParallel", "ModuleRule",
           "TPRegistry", "DEFAULT_REGISTRY", "ApplyContext", "PlanError", "PlanTypeError", "PlanWarning",
           "NoMeshError", "UnsupportedModuleTypeError", "LayoutsMismatchError", "loss_parallel",
           "vocab_parallel_cross_entropy", "local_shard_range", "to_local_share"]
