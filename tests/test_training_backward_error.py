"""A backward that raises, caught by the training loop (the batch skipped): the next step
trains as if the failed one had never run ([Note: a backward that raised] in
``composable/_fsdp/_state.py``)."""

from __future__ import annotations

import copy

import pytest
import torch

from shardwise.composable import fully_shard
from tests._compare import maxerr
from tests._dist import run_ranks
from tests._models import Net, batches, loss_fn, make_mesh, max_param_error, step_pair

TOL = 1e-6


class _Boom(torch.autograd.Function):
    """Identity in forward; its backward raises (a user error in a custom autograd Function)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in backward")


def _raise(grad):
    """A tensor hook that raises (e.g. a NaN check)."""
    raise RuntimeError("boom in backward")


class BoomNet(Net):
    """``boom`` = "middle": a raising Function between the two blocks (block 1 has already
    issued its reduction when it raises); "output": a raising hook on the model's output (only
    the root's pre-backward ran)."""

    boom: str | None = None

    def forward(self, tokens):
        x = self.blocks[0](self.emb(tokens))
        if self.boom == "middle":
            x = _Boom.apply(x)
        out = self.head(self.blocks[1](x)) * self.scale.sum()
        if self.boom == "output":
            out.register_hook(_raise)
        return out


def _recover(rank, world_size, where, raf):
    torch.manual_seed(0)
    ref = BoomNet()
    model = copy.deepcopy(ref)
    mesh = make_mesh((world_size,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=raf)
    fully_shard(model, mesh=mesh, reshard_after_forward=raf)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per = 8 // world_size
    sl = slice(rank * per, (rank + 1) * per)
    worst, raised = 0.0, None
    for step, (tokens, target) in enumerate(batches(4, 8)):
        if step == 1:  # the failed step: the reference never runs it
            model.boom = where
            try:
                loss_fn(model(tokens[sl]), target[sl]).backward()
            except RuntimeError as e:
                raised = str(e)
            model.boom = None
            opt.zero_grad()
            continue
        worst = maxerr(worst, step_pair(ref, ropt, model, opt, tokens, target, sl))
    return raised, worst, max_param_error(ref, model)


@pytest.mark.parametrize("where", ["middle", "output"])
@pytest.mark.parametrize("raf", [True, False])
def test_training_continues_after_a_backward_that_raised(where, raf):
    for rank, (raised, loss_err, errs) in enumerate(run_ranks(_recover, 2, where, raf)):
        assert raised == "boom in backward", f"rank {rank}: the failed step did not raise as planned: {raised!r}"
        assert loss_err <= TOL, f"rank {rank}: loss differs by {loss_err:.2e}"
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: parameters differ from the reference that skipped the step: {bad}"
