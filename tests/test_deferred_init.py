"""Deferred initialisation on the meta device and loading from rank 0: every rank's shards
equal the single-device values bit for bit, one unit unsharded at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from examples.model import Llama, LlamaConfig
from shardwise.composable import broadcast_from_rank0, fully_shard, materialize
from shardwise.composable._fsdp import _materialize as mat
from tests._dist import run_ranks
from tests._models import Block, make_mesh

CFG = LlamaConfig(vocab_size=37, dim=24, n_layers=3, n_heads=4, max_seq_len=16)


def _shard(model, mesh, blocks):
    for b in blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _full(model):
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()) for n, p in model.named_parameters()}


def _deferred_llama(rank, world_size, mesh_shape):
    mesh = make_mesh(mesh_shape)
    with torch.device("meta"):
        model = Llama(CFG)
    _shard(model, mesh, model.layers)
    alive = []
    real = mat._Placeholders._activate

    def activate(self, g):
        real(self, g)
        alive.append(sum(1 for h in self.groups if any(self.full[id(p)].untyped_storage().size() for p in h.params)))

    mat._Placeholders._activate = activate
    try:
        materialize(model, lambda m: m.init_weights(torch.Generator().manual_seed(7)))
    finally:
        mat._Placeholders._activate = real
    ref = Llama(CFG, generator=torch.Generator().manual_seed(7))
    got, want = _full(model), _full(ref)
    bad = [n for n in want if not torch.equal(got[n], want[n])]
    assert not bad, f"differ from the single-device init: {bad}"
    assert torch.equal(model.rope_cos, ref.rope_cos), "meta buffers initialised by init_weights"
    assert max(alive) == 1, f"more than one unit unsharded during init: {alive}"
    # the root's init_weights comes back to the root unit after the blocks: it was restored
    return len(alive)


@pytest.mark.parametrize("world_size,mesh_shape", [(2, (2,)), (4, (4,)), (4, (2, 2))])
def test_meta_init_matches_single_device_bit_for_bit(world_size, mesh_shape):
    counts = run_ranks(_deferred_llama, world_size, mesh_shape)
    assert counts[0] >= CFG.n_layers + 2, "root activated, blocks, then the root again"


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 6)
        self.blocks = nn.ModuleList(Block(6) for _ in range(2))
        self.head = nn.Linear(6, 5)


def _default_reset_parameters(rank, world_size):
    with torch.device("meta"):
        model = Plain()
    _shard(model, make_mesh((world_size,)), model.blocks)
    torch.manual_seed(3)
    materialize(model)
    torch.manual_seed(3)
    ref = Plain()
    got, want = _full(model), _full(ref)
    return [n for n in want if not torch.equal(got[n], want[n])]


def test_default_init_runs_reset_parameters_in_module_order():
    assert run_ranks(_default_reset_parameters, 2) == [[], []]


def _untouched(rank, world_size):
    with torch.device("meta"):
        model = Plain()
        model.extra = nn.Parameter(torch.ones(4))
    _shard(model, make_mesh((world_size,)), model.blocks)
    try:
        materialize(model)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_parameters_left_uninitialised_are_an_error():
    msg = run_ranks(_untouched, 2)[0]
    assert "did not initialise ['extra']" in msg, msg


def _from_rank0(rank, world_size, mesh_shape, src=0, fenced=False):
    """``fenced``: ``torch.distributed`` inside ``_materialize`` is `_NoCollectives` meanwhile."""
    import shardwise.composable._fsdp._materialize as m

    mesh = make_mesh(mesh_shape)
    if rank == src:
        model = Llama(CFG, generator=torch.Generator().manual_seed(5))
        full = model.state_dict()
    else:
        with torch.device("meta"):
            model = Llama(CFG)
        full = None
    _shard(model, mesh, model.layers)
    real = m.dist
    if fenced:
        m.dist = _NoCollectives()
    try:
        broadcast_from_rank0(model, full, src_rank=src)
    finally:
        m.dist = real
    ref = Llama(CFG, generator=torch.Generator().manual_seed(5))
    got, want = _full(model), _full(ref)
    bad = [n for n in want if not torch.equal(got[n], want[n])]
    assert torch.equal(model.rope_sin, ref.rope_sin), "buffers come from the source rank"
    local = sum(p.to_local().numel() for p in model.parameters())
    return bad, local, sum(p.numel() for p in ref.parameters())


@pytest.mark.parametrize("world_size,mesh_shape", [(2, (2,)), (4, (2, 2))])
def test_broadcast_from_rank0_fills_every_shard(world_size, mesh_shape):
    for rank, (bad, local, total) in enumerate(run_ranks(_from_rank0, world_size, mesh_shape)):
        assert not bad, f"rank {rank}: {bad}"
        assert local < total, f"rank {rank} holds only its shards ({local} of {total})"


def _bad_source(rank, world_size, case):
    mesh = make_mesh((world_size,))
    torch.manual_seed(0)
    model = Llama(CFG)
    full = dict(model.state_dict()) if rank == 0 else None
    if case == "none":
        full = None
    elif case == "missing" and rank == 0:
        full.pop("output.weight")
    elif case == "shape" and rank == 0:
        full["output.weight"] = full["output.weight"][:1]
    _shard(model, mesh, model.layers)
    try:
        broadcast_from_rank0(model, full)
    except (KeyError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("case,text", [("none", "ValueError: broadcast_from_rank0: the source rank must pass"),
                                       ("missing", "KeyError: \"broadcast_from_rank0: 'output.weight' is missing"),
                                       ("shape", "ValueError: broadcast_from_rank0: 'output.weight' has shape (1,")])
def test_a_bad_source_state_dict_is_one_error_on_every_rank(case, text):
    """The source's state dict is checked before any scatter: every rank raises the same error
    (before, only the source raised and the others waited in the scatter)."""
    got = run_ranks(_bad_source, 2, case, timeout=60)
    assert got[0] == got[1] and got[0].startswith(text), got


class _NoCollectives:
    """Stands in for ``torch.distributed`` inside ``_materialize``: asking for anything but the
    rank is a collective of deferred init's own."""

    def __getattr__(self, name):
        if name in ("get_rank", "get_world_size", "is_initialized"):
            return getattr(torch.distributed, name)
        raise AssertionError(f"deferred init called torch.distributed.{name} itself")


def test_broadcast_from_another_rank_through_the_one_scatter():
    """``src_rank=1`` sends rank 1's state dict; deferred init itself calls no collective (every
    byte goes through ``shardwise.checkpoint.scatter_full``)."""
    for rank, (bad, _, _) in enumerate(run_ranks(_from_rank0, 2, (2,), 1, True)):
        assert not bad, f"rank {rank}: {bad}"
