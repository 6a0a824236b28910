"""The explicit states of a unit (issue 14.2): what it is doing (``TrainingState``), where its
parameters are (``ShardState``), how far each gradient reduction got (``ReduceStage``), and that
an impossible transition is refused instead of silently corrupting a step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from shardwise.composable import MixedPrecisionPolicy, fully_shard
from shardwise.composable._fsdp._common import ShardState, TrainingState
from shardwise.composable._fsdp._reduce import PendingReduce, ReduceStage
from shardwise.composable._fsdp._state import FSDPState, get_state
from tests._dist import run_ranks
from tests._models import batches, loss_fn, make_mesh, reference_and_copy


def _states_over_a_step(rank, world_size):
    mesh = make_mesh((world_size,))
    _, model = reference_and_copy()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    seen = []
    block = model.blocks[0]
    st = get_state(block)

    def in_backward(grad):  # registered after the unit's own pre-backward hook: runs after it
        seen.append(("backward", st.training, st.group.state))

    def pre(module, args):  # runs after the unit's pre-forward (which is prepended)
        seen.append(("forward", st.training, st.group.state))

    def post(module, args, out):  # runs after the unit's post-forward
        seen.append(("after forward", st.training, st.group.state))
        out.register_hook(in_backward)

    block.register_forward_pre_hook(pre)
    block.register_forward_hook(post)
    tokens, target = batches(1, 4)[0]
    loss_fn(model(tokens), target).backward()
    after = [(s.training, s.group.state) for s in (get_state(model), *map(get_state, model.blocks))]
    return seen, after, get_state(model).ctx is st.ctx and st.ctx.root is get_state(model)


def test_training_and_shard_states_over_one_step():
    for rank, (seen, after, shared) in enumerate(run_ranks(_states_over_a_step, 2)):
        assert seen == [
            ("forward", TrainingState.FORWARD, ShardState.UNSHARDED),
            ("after forward", TrainingState.IDLE, ShardState.SHARDED),
            ("backward", TrainingState.BACKWARD, ShardState.UNSHARDED),
        ], f"rank {rank}: states seen by block 0 over one step: {seen}"
        assert after == [(TrainingState.IDLE, ShardState.SHARDED)] * 3, f"rank {rank}: after the step {after}"
        assert shared, f"rank {rank}: the units do not share the root's RootContext"


def test_impossible_training_transition_is_refused():
    state = FSDPState([nn.Linear(2, 2)], None, None, None, MixedPrecisionPolicy())
    assert state.training is TrainingState.IDLE
    with pytest.raises(AssertionError, match="IDLE -> IDLE"):
        state._set_training(TrainingState.IDLE)
    state._set_training(TrainingState.FORWARD)
    state._set_training(TrainingState.IDLE)
    assert state.training is TrainingState.IDLE


def test_a_finished_reduction_cannot_move_on():
    pr = PendingReduce(SimpleNamespace(label="Block"), None, None, torch.zeros(1), True)
    assert pr.stage is ReduceStage.SCATTER
    pr._to(ReduceStage.ALL_REDUCE)
    pr._to(ReduceStage.DONE)
    with pytest.raises(AssertionError, match=r"fully_shard\(Block\): reduction stage DONE -> ALL_REDUCE"):
        pr._to(ReduceStage.ALL_REDUCE)
