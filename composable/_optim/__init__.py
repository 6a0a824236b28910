"""Optimizers that need whole matrices (Muon, Shampoo-style) on sharded parameters: one owner
rank per matrix gathers it, updates it whole and sends the new rows back
([Note: the whole-matrix step] in ``composable/_optim/_whole_matrix.py``; docs/optimizers.md).

| module | what |
| --- | --- |
| `_owners.py` | `plan_owners`: which rank of a gather group owns which tensor (balanced, no collective) |
| `_pieces.py` | `pieces_of`: a sharded tensor's gather group and every member's piece |
| `_exchange.py` | `start_exchange`: one all-to-all of tensors of any shapes and dtypes |
| `_protocol.py` | the ``needs_whole_matrices`` protocol, its registry, `split_matrix_params` |
| `_whole_matrix.py` | `WholeMatrixOptimizer` |
"""

from ._owners import OwnerPlan, plan_owners
from ._protocol import (WHOLE_MATRIX_ATTR, needs_whole_matrices, register_whole_matrix_optimizer,
                        split_matrix_params)
from ._whole_matrix import WholeMatrixOptimizer

__all__ = ["OwnerPlan", "WHOLE_MATRIX_ATTR", "WholeMatrixOptimizer", "needs_whole_matrices", "plan_owners",
           "register_whole_matrix_optimizer", "split_matrix_params"]
