"""Save the example Llama from 2 x 2 FSDP x TP (``_StridedShard`` and ``(Shard(0), Shard(1))``
placements) and load it into other layouts: plain, FSDP on 3 ranks, TP on 2 ranks. Model and
AdamW state, bit-exact."""

from __future__ import annotations

import torch
import torch._dynamo  # noqa: F401  preloaded into the forkserver (DTensor imports it lazily)
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import _StridedShard

import shardwise.composable as sw
from examples.model import Llama, LlamaConfig
from examples.parallel import apply_fsdp, apply_tp
from shardwise.checkpoint import load, save, set_optimizer_state_dict
from shardwise.mesh import data_parallel_mesh, init_mesh
from tests._dist import run_ranks
from tests.test_checkpoint import app_state, assert_equal_states, full

CFG = LlamaConfig(vocab_size=13, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=24, max_seq_len=16)


def _llama(dp_shard: int, tp: int, seed: int):
    """The Llama on a (1, dp_shard, tp) mesh (plain when both are 1), and its AdamW."""
    model = Llama(CFG, generator=torch.Generator().manual_seed(seed))
    mesh = None
    if dp_shard * tp > 1:
        mesh = init_mesh(dp_replicate=1, dp_shard=dp_shard, tp=tp, device_type="cpu")
        if tp > 1:
            apply_tp(model, mesh["tp"])
        if dp_shard > 1:
            apply_fsdp(model, data_parallel_mesh(mesh))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh


def _save_fsdp_tp(rank, world_size, path):
    model, optim, mesh = _llama(2, 2, seed=0)
    strided = sum(isinstance(p.placements[0], _StridedShard) for p in model.parameters())
    tokens = torch.randint(0, CFG.vocab_size, (4, 7), generator=torch.Generator().manual_seed(1))
    dp = mesh.get_coordinate()[1]
    inputs, targets = tokens[2 * dp: 2 * dp + 2, :-1], tokens[2 * dp: 2 * dp + 2, 1:]
    with sw.loss_parallel():
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    optim.step()
    state = app_state(model, optim, step=1)
    save(state, path)
    return full(state), strided


def _load(rank, world_size, path, dp_shard, tp):
    model, optim, _ = _llama(dp_shard, tp, seed=3)
    state = app_state(model, optim)
    load(state, path)
    set_optimizer_state_dict(model, optim, state["optim"])
    return full(app_state(model, optim, step=state["trainer"]["step"]))


def test_fsdp_x_tp_checkpoint_loads_into_other_layouts(tmp_path):
    path = str(tmp_path / "fsdp_tp")
    saved = run_ranks(_save_fsdp_tp, 4, path, timeout=90)
    want, strided = saved[0]
    assert strided > 0, "FSDP x TP gives _StridedShard placements"
    for dp_shard, tp, world in ((1, 1, 1), (3, 1, 3), (1, 2, 2)):
        for rank, got in enumerate(run_ranks(_load, world, path, dp_shard, tp, timeout=90)):
            assert_equal_states(got, want, f"FSDP x TP -> dp_shard={dp_shard} tp={tp}, rank {rank}")
