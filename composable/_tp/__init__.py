"""Tensor parallelism on DTensor: ``parallelize_module``, the styles, ``loss_parallel``.

One file per concept:

| file | concept |
| --- | --- |
| `_layouts.py` | activation layouts: local tensor <-> DTensor with exact (uneven) sizes |
| `_params.py` | parameters -> DTensors on the tp mesh; gradients keep the parameter's layout |
| `_registry.py` | the extension point: `ModuleRule`, the immutable `TPRegistry` |
| `_styles.py` | rule-driven styles: `ModuleParallel`, `ColwiseParallel`, `RowwiseParallel` |
| `_embedding.py` | the vocabulary-parallel embedding (Rowwise ``nn.Embedding``) |
| `_builtin.py` | the rules for ``nn.Linear`` / ``nn.Embedding``, ``DEFAULT_REGISTRY`` |
| `_sequence.py` | `SequenceParallel` (norms, dropout on sequence shards) |
| `_prepare.py` | `PrepareModuleInput` / `PrepareModuleOutput` / `PrepareModuleInputOutput` |
| `_torch_styles.py` | plans built from torch's style classes (and torchao's float8 subclasses) |
| `_plan.py` | `parallelize_module`: FQN patterns, near-miss errors |
| `_loss.py` | `vocab_parallel_cross_entropy`, `loss_parallel` |
| `_compat.py` | the torch private API used: the mesh of a ``with mesh:`` block, torch styles' fields |

See docs/tensor_parallel.md.
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
