"""Bad input to the pipeline ends with one line, the same on every rank, before anything waits
(issue 20, items 8 and 9): a ``sample`` that raises on one rank only, ranks that build models of
different depth, a ``pp_mesh`` that is not a mesh, a model passed where a split belongs, no
``loss_fn``, a model split twice, and ``init_mesh`` device types this host cannot use. Before,
the first two hung until the collective timeout and the others raised AttributeErrors, failed
only at ``step()``, or said "only 1 blocks"."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.composable import PipelineSchedule, pipeline_split
from shardwise.mesh import init_mesh
from tests._dist import run_ranks


class Chain(torch.nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                                          for _ in range(n))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        for blk in self.layers:
            h = blk(h)
        return self.head(h)


def _outcome(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _sample_fails_on_one_rank(rank, world_size, cost):
    torch.manual_seed(0)
    model, x, y = Chain(), torch.randn(8, 4), torch.randn(8, 3)

    def sample(m):
        if rank == world_size - 1:
            raise ZeroDivisionError("no data on this rank")
        return F.mse_loss(m(x), y)

    return _outcome(lambda: pipeline_split(model, cost=cost, sample=sample, verbose=False))


@pytest.mark.parametrize("cost", ["time", "activations", "params"])
def test_a_sample_that_raises_on_one_rank_fails_every_rank(cost):
    got = run_ranks(_sample_fails_on_one_rank, 3, cost, timeout=60)
    assert len(set(got)) == 1, got
    assert got[0] == "RuntimeError: pipeline_split failed on rank 2: ZeroDivisionError: no data on this rank", got


def _depths_differ(rank, world_size, cost):
    torch.manual_seed(0)
    model, x, y = Chain(3 if rank == 0 else 2), torch.randn(8, 4), torch.randn(8, 3)
    return _outcome(lambda: pipeline_split(model, cost=cost, sample=lambda m: F.mse_loss(m(x), y), verbose=False))


@pytest.mark.parametrize("cost", ["time", "params"])
def test_models_of_different_depth_fail_every_rank(cost):
    got = run_ranks(_depths_differ, 2, cost, timeout=60)
    assert len(set(got)) == 1, got
    assert got[0].startswith("ValueError: pipeline_split: the ranks were given different models (rank 0: 3 blocks"), got
    assert "rank 1: 2 blocks" in got[0] and "build the same model" in got[0], got


def _the_same_error_everywhere(rank, world_size):
    torch.manual_seed(0)
    return _outcome(lambda: pipeline_split(Chain(1), cost="params", verbose=False))  # 2 stages, 1 block


def test_an_error_every_rank_hits_is_raised_as_is():
    got = run_ranks(_the_same_error_everywhere, 2, timeout=60)
    assert got == ["ValueError: pipeline: 2 stages but the model has only 1 blocks to split; every stage needs at "
                   "least one block: use at most 1 stages (pp x virtual stages), or a model with more blocks"] * 2, got


def test_wrong_arguments_are_named():
    with pytest.raises(TypeError, match="pipeline_split: pp_mesh must be a DeviceMesh .* got str 'pp'"):
        pipeline_split(Chain(), "pp", cost="params", verbose=False)
    with pytest.raises(TypeError, match="PipelineSchedule: split must be the PipelineSplit .* got Chain"):
        PipelineSchedule(Chain(), microbatches=2, loss_fn=F.mse_loss)
    split = pipeline_split(Chain(), cost="params", verbose=False)
    with pytest.raises(TypeError, match="PipelineSchedule: loss_fn must be a callable .* got None"):
        PipelineSchedule(split, microbatches=2, loss_fn=None)


def test_splitting_a_split_model_again_says_so():
    split = pipeline_split(Chain(), virtual_stages=2, cost="params", verbose=False)
    for again in (split.module, split.stages[1].module):
        with pytest.raises(ValueError, match="this model was already split .* build it again"):
            pipeline_split(again, cost="params", verbose=False)


def _devices(rank, world_size):
    out = {}
    for dev in ("cuda", "tpu", 3):
        if dev == "cuda" and torch.cuda.is_available():
            continue
        out[str(dev)] = _outcome(lambda dev=dev: init_mesh(device_type=dev))
    out["cpu"] = tuple(init_mesh(device_type="cpu").shape)
    return out


def test_init_mesh_refuses_device_types_this_host_cannot_use():
    (got,) = run_ranks(_devices, 1, timeout=60)
    assert got["cpu"] == (1, 1, 1)
    if "cuda" in got:
        assert got["cuda"].startswith("ValueError: init_mesh(device_type='cuda'): torch.cuda.is_available() is False "
                                      "on this host; use device_type='cpu'"), got["cuda"]
    assert got["tpu"].startswith("ValueError: init_mesh(device_type='tpu'): not a device type torch knows here; use "
                                 "'cpu' or 'cuda'"), got["tpu"]
    assert got["3"].startswith("TypeError: init_mesh(device_type=3): pass a device type string"), got["3"]
