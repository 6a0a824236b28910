"""The strategy table ([Note: the strategy table] in composable/_wrap/_strategies.py): every
strategy is one row, and every strategy-dependent rule reads it."""

from __future__ import annotations

import pytest

from shardwise.composable import ShardingStrategy, plan_memory
from shardwise.composable._wrap import STRATEGIES, StrategySpec
from tests._models import Net

ACCELERATE = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]  # its 1..5


def test_one_row_per_member_and_accelerates_numbers():
    assert {m.value for m in ShardingStrategy} == set(STRATEGIES)
    for i, name in enumerate(ACCELERATE, start=1):
        assert ShardingStrategy.parse(i) is ShardingStrategy(name)
        assert ShardingStrategy.parse(str(i)) is ShardingStrategy(name)
        assert STRATEGIES[name].accelerate == i
    with pytest.raises(ValueError, match="Accelerate's numbers"):
        ShardingStrategy.parse(9)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_planner_and_mesh_rule_agree(name):
    """The planner refuses exactly the meshes the table's rule refuses, with its words."""
    spec = STRATEGIES[name]
    for R, S in [(1, 4), (2, 2), (4, 1)]:
        problem = spec.mesh_problem(R, S)
        if problem is None:
            plan_memory(Net(), (R, S), name)
        else:
            with pytest.raises(ValueError) as err:
                plan_memory(Net(), (R, S), name)
            assert problem in str(err.value)


def test_a_spec_checks_its_mesh_kind():
    with pytest.raises(ValueError, match="mesh="):
        StrategySpec("X", None, True, "ring", "?")
