"""Optimizers that need whole matrices (Muon, Shampoo-style) on sharded parameters: one owner
rank per matrix gathers it, updates it whole and sends the new rows back
([Note: the whole-matrix step] in ``composable/_optim/_whole_matrix.py``; docs/optimizers.md).
"""

from ._owners import OwnerPlan, plan_owners
from ._protocol import (WHOLE_MATRIX_ATTR, needs_whole_matrices, register_whole_matrix_optimizer,
                        split_matrix_params)
from ._whole_matrix import WholeMatrixOptimizer

__all__ = ["OwnerPlan", "WHOLE_MATRIX_ATTR", "WholeMatrixOptimizer", "needs_whole_matrices", "plan_owners",
           "register_whole_matrix_optimizer", "split_matrix_params"]
