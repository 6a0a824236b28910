"""The optimizer face of ``shardwise.composable``: optimizers that need whole matrices (Muon,
Shampoo-style) on sharded parameters, at 1/W of the work. See docs/optimizers.md.

    from shardwise.composable.optim import WholeMatrixOptimizer, split_matrix_params
"""

from ._optim import (OwnerPlan, WholeMatrixOptimizer, needs_whole_matrices, plan_owners,
                     register_whole_matrix_optimizer, split_matrix_params)

__all__ = ["WholeMatrixOptimizer", "needs_whole_matrices", "register_whole_matrix_optimizer",
           "split_matrix_params", "OwnerPlan", "plan_owners"]
