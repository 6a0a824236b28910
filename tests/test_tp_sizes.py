"""Plain ``Shard`` inputs: equal pieces cost no size exchange; uneven ones are opt-in.

[Note: no size exchange by default] in ``composable/_tp/_layouts.py``: a sequence-parallel MLP
step issues exactly torch's collectives (2 all-gathers, 1 reduce-scatter), and
``uneven_shards=True`` adds one length exchange per plain sharded input and call.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.debug import CommDebugMode

from shardwise.composable import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from tests._dist import run_ranks
from tests.test_tp import init_, rel, tp_mesh


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1, self.net2 = nn.Linear(6, 8), nn.Linear(8, 6)

    def forward(self, x):
        return self.net2(torch.relu(self.net1(x)))


def _counts(comm: CommDebugMode) -> dict[str, int]:
    return {str(op).rpartition(".")[2]: n for op, n in comm.get_comm_counts().items() if n}


def _sequence_parallel_step(rank, world_size, uneven):
    mesh = tp_mesh(world_size)
    ref = init_(MLP(), seed=0)
    tp = parallelize_module(copy.deepcopy(ref), mesh, {
        "net1": ColwiseParallel(input_layouts=Shard(0), uneven_shards=uneven),
        "net2": RowwiseParallel(output_layouts=Shard(0), uneven_shards=uneven)})
    x = torch.randn(4 * world_size, 6, generator=torch.Generator().manual_seed(1))
    mine = x.chunk(world_size)[rank]
    with CommDebugMode() as comm:
        out = tp(mine)
        out.sum().backward()
    want = ref(x)
    want.sum().backward()
    return _counts(comm), rel(out, want.chunk(world_size)[rank]), rel(tp.net1.weight.grad, ref.net1.weight.grad)


def test_plain_shard_inputs_cost_no_size_exchange():
    for counts, out_err, grad_err in run_ranks(_sequence_parallel_step, 2, False):
        assert counts == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 1}, counts
        assert out_err <= 1e-6 and grad_err <= 1e-6, (out_err, grad_err)
    for counts, out_err, grad_err in run_ranks(_sequence_parallel_step, 2, True):
        assert sum(counts.values()) > 3, f"uneven_shards=True should exchange lengths: {counts}"
        assert out_err <= 1e-6 and grad_err <= 1e-6, (out_err, grad_err)


def _uneven_sequence(rank, world_size):
    mesh = tp_mesh(world_size)
    norm = init_(nn.LayerNorm(4), seed=2)
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(3))  # 5 tokens: 3 + 2 on 2 ranks
    mine = x.chunk(world_size, dim=1)[rank]
    out = {}
    sp = parallelize_module(copy.deepcopy(norm), mesh, SequenceParallel(uneven_shards=True))
    y = sp(mine)
    out["opt_in"] = (tuple(y.shape), rel(y.full_tensor(), norm(x)))
    eq = parallelize_module(copy.deepcopy(norm), mesh, SequenceParallel())
    out["default_shape"] = tuple(eq(mine).shape)  # torch's assumption: p x local
    return out


def test_uneven_sequence_pieces_need_the_opt_in():
    for r in run_ranks(_uneven_sequence, 2):
        assert r["opt_in"][0] == (2, 5, 4) and r["opt_in"][1] <= 1e-6, r
        assert r["default_shape"] in ((2, 6, 4), (2, 4, 4)), r  # 2 x 3 on rank 0, 2 x 2 on rank 1
