"""The pipeline transport ([Note: messages between stages]): one message per transfer once a
channel's shape is known, shapes that change between steps, and failures while a peer waits
for a message of a known size (error inline, or too long for it)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.composable._pipeline import PipelineError, PipelineSchedule, pipeline_split
from tests._dist import run_ranks

TOL = 1e-6


class Block(torch.nn.Module):
    """Linear + tanh; raises in its forward at call number ``at`` (counted from 1; 0: never)."""

    def __init__(self, w, at=0):
        super().__init__()
        self.lin, self.at, self.calls = torch.nn.Linear(w, w), at, 0

    def forward(self, h):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError(f"boom at call {self.calls}")
        return torch.tanh(self.lin(h))


class Chain(torch.nn.Module):
    """``head(layers(inp(x)))`` with ``n`` blocks of width ``w``; block ``boom`` raises at call ``at``."""

    def __init__(self, n=4, w=8, boom=None, at=0):
        super().__init__()
        self.inp = torch.nn.Linear(4, w)
        self.layers = torch.nn.ModuleList(Block(w, at if i == boom else 0) for i in range(n))
        self.head = torch.nn.Linear(w, 3)

    def forward(self, x):
        h = self.inp(x)
        for blk in self.layers:
            h = blk(h)
        return self.head(h)


def _count_sends(counter):
    real = dist.batch_isend_irecv

    def counting(ops):
        counter[0] += sum(op.op is dist.isend for op in ops)
        return real(ops)
    return counting


def _varying(rank, world_size, schedule):
    torch.manual_seed(0)
    ref = Chain()
    split = pipeline_split(copy.deepcopy(ref), virtual_stages=2 if schedule == "interleaved_1f1b" else 1,
                           cost="params", verbose=False)
    sched = PipelineSchedule(split, schedule=schedule, microbatches=world_size, loss_fn=F.mse_loss)
    sends = [0]
    dist.batch_isend_irecv = _count_sends(sends)
    out = []
    for step, n in enumerate([8, 8, 4, 12, 12]):  # microbatches of 2, 2, 1, 3, 3 rows
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)
        ref.zero_grad()
        split.module.zero_grad()
        F.mse_loss(ref(x), y).backward()
        before = sends[0]
        losses = sched.step(x, y)
        mine = dict(split.module.named_parameters())
        err = max(((p.grad - mine[k].grad).abs().max() / p.grad.abs().max()).item()
                  for k, p in ref.named_parameters() if k in mine)
        ref_losses = [F.mse_loss(ref(a), b).item() for a, b in zip(x.chunk(world_size), y.chunk(world_size))]
        out.append({"sends": sends[0] - before, "grad_err": err,
                    "loss_err": max(abs(a - b) for a, b in zip(losses.tolist(), ref_losses))})
    transfers = len(sched._sends_of(split.pp_rank))
    return out, transfers


@pytest.mark.parametrize("world,schedule", [(2, "1f1b"), (4, "gpipe"), (2, "interleaved_1f1b")])
def test_one_message_per_transfer_and_shapes_that_change_between_steps(world, schedule):
    for steps, transfers in run_ranks(_varying, world, schedule, timeout=90):
        assert transfers > 0
        for i, s in enumerate(steps):
            assert s["grad_err"] <= TOL and s["loss_err"] <= TOL, (i, s)
        # a new shape (steps 0, 2, 3) costs a header message per channel; a known one (1, 4) none
        assert steps[1]["sends"] == steps[4]["sends"] == transfers, steps
        for i in (0, 2, 3):
            assert transfers < steps[i]["sends"] <= 2 * transfers, (i, steps)


def _fails_later(rank, world_size, width):
    torch.manual_seed(0)
    model = Chain(w=width, boom=2, at=world_size + 3)  # step 2, microbatch 3: channels know the shape
    split = pipeline_split(model, cost="params", verbose=False)
    sched = PipelineSchedule(split, schedule="1f1b", microbatches=world_size, loss_fn=F.mse_loss)
    x, y = torch.randn(2 * world_size, 4), torch.randn(2 * world_size, 3)
    try:
        for _ in range(3):
            sched.step(x, y)
    except PipelineError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("width", [8, 256])  # error text longer / shorter than the awaited message
def test_failure_while_peers_wait_for_a_known_shape_is_one_error(width):
    got = run_ranks(_fails_later, 4, width, timeout=60)
    assert len(set(got)) == 1, f"ranks disagree: {got}"
    assert got[0].startswith("pipeline stage 2 (pp rank 2) failed in forward of microbatch 2: RuntimeError: "
                             "boom at call 7") and "\n" not in got[0], got[0]


def _rebuild_after_failure(rank, world_size, boom_stage_block):
    torch.manual_seed(0)
    model = Chain(w=8, boom=boom_stage_block, at=world_size + 2)  # fails in the second step
    ref = copy.deepcopy(model)
    split = pipeline_split(model, cost="params", verbose=False)
    sched = PipelineSchedule(split, schedule="1f1b", microbatches=world_size, loss_fn=F.mse_loss)
    x, y = torch.randn(2 * world_size, 4), torch.randn(2 * world_size, 3)
    sched.step(x, y)
    try:
        sched.step(x, y)
        return "no error"
    except PipelineError as exc:
        first = str(exc)
    sched.close()
    for blk in split.module.modules():
        if isinstance(blk, Block):
            blk.at = 0
    fresh = PipelineSchedule(split, schedule="1f1b", microbatches=world_size, loss_fn=F.mse_loss)
    split.module.zero_grad()
    ref.zero_grad()
    for blk in ref.modules():
        if isinstance(blk, Block):
            blk.at = 0
    F.mse_loss(ref(x), y).backward()
    losses = fresh.step(x, y)
    mine = dict(split.module.named_parameters())
    err = max(((p.grad - mine[k].grad).abs().max() / p.grad.abs().max()).item()
              for k, p in ref.named_parameters() if k in mine)
    return first, err, losses.tolist()


@pytest.mark.parametrize("block", [0, 3])  # first stage (its sends were in flight) / last stage
def test_a_new_schedule_after_a_failed_step_trains_correctly(block):
    """After a failed step, a new PipelineSchedule on the same split (as the error says) must not
    take messages left over from the failed step: same gradients as one process."""
    got = run_ranks(_rebuild_after_failure, 4, block, timeout=60)
    assert len({g[0] for g in got}) == 1 and "boom" in got[0][0], got
    for first, err, _ in got:
        assert err <= TOL, got
