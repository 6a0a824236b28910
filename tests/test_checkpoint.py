"""shardwise.checkpoint on real gloo ranks: save from one layout, load into another, bit-exact.

Layouts are strings: ``"plain"`` (one process, no sharding), ``"fsdp<W>"`` (fully_shard on a
1-D mesh of W ranks), ``"hsdp<R>x<S>"`` (fully_shard on an R x S mesh). Every comparison is
``torch.equal`` against the full tensors the saving ranks held (``full_tensor()``), except the
training continuation on another layout, which is compared like the fully_shard parity tests.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from shardwise.checkpoint import (
    get_model_state_dict,
    get_optimizer_state_dict,
    load,
    save,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from shardwise.composable import fully_shard
from tests._dist import run_ranks
from tests._models import batches, loss_fn, make_mesh, reference_and_copy

TOL = 1e-6  # as in test_fully_shard: another layout reorders the gradient sums
SAVE_STEPS, MORE_STEPS, BATCH = 2, 2, 12  # 12 rows split evenly over 1, 2, 3 and 4 ranks


# -- helpers shared by the checkpoint test modules ---------------------------------------------

def mesh_shape(layout: str) -> tuple[int, ...] | None:
    if layout == "plain":
        return None
    if layout.startswith("fsdp"):
        return (int(layout[4:]),)
    r, s = layout[4:].split("x")
    return (int(r), int(s))


def build(layout: str, seed: int = 0):
    """A Net (seeded) sharded as ``layout`` and its AdamW."""
    _, model = reference_and_copy(seed)
    shape = mesh_shape(layout)
    if shape is not None:
        mesh = make_mesh(shape)
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def app_state(model, optim, step: int = 0) -> dict:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim),
            "trainer": {"step": step, "name": "net"}}


def full(state: dict) -> dict:
    """Flat ``{key: full tensor}`` of a state's tensors (collective for DTensors)."""
    out = {}

    def walk(v, key):
        if isinstance(v, torch.Tensor):
            out[key] = v.full_tensor() if isinstance(v, DTensor) else v.detach().clone()
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{key}/{k}" if key else str(k))

    walk(state, "")
    return out


def train(model, optim, steps, start: int = 0, world_size: int | None = None):
    world_size = world_size or (dist.get_world_size() if dist.is_initialized() else 1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    per = BATCH // world_size
    for tokens, target in batches(start + steps, BATCH)[start:]:
        sl = slice(rank * per, (rank + 1) * per)
        loss_fn(model(tokens[sl]), target[sl]).backward()
        optim.step()
        optim.zero_grad()


def assert_equal_states(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), f"{where}: keys differ: {sorted(got.keys() ^ want.keys())}"
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), f"{where}: '{k}' differs"


# -- save from FSDP and HSDP, load everywhere ----------------------------------------------------

def _save_then_continue(rank, world_size, layout, path):
    model, optim = build(layout)
    train(model, optim, SAVE_STEPS)
    state = app_state(model, optim, step=SAVE_STEPS)
    save(state, path)
    saved = full(state)
    train(model, optim, MORE_STEPS, start=SAVE_STEPS)
    final = full(app_state(model, optim))
    return (saved, final) if rank == 0 else None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{layout: (path, full state at the save, full state after MORE_STEPS more)}``."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for layout, world in (("fsdp4", 4), ("hsdp2x2", 4)):
        path = str(root / layout)
        at_save, final = run_ranks(_save_then_continue, world, layout, path, timeout=90)[0]
        out[layout] = (path, at_save, final)
    return out


def _load_and_continue(rank, world_size, layout, path, more_steps):
    model, optim = build(layout, seed=123)  # other initial values: everything must come from the file
    state = app_state(model, optim)
    stats = load(state, path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    loaded = full(app_state(model, optim, step=state["trainer"]["step"]))
    lr_ok = all(g["lr"] == 1e-2 and g["betas"] == (0.9, 0.999) for g in optim.param_groups)
    train(model, optim, more_steps, start=state["trainer"]["step"])
    final = full(app_state(model, optim)) if more_steps else None
    return {"loaded": loaded, "final": final, "step": state["trainer"]["step"], "lr_ok": lr_ok, "stats": stats}


LOADS = [("fsdp4", "plain", 1), ("fsdp4", "fsdp2", 2), ("fsdp4", "fsdp3", 3), ("fsdp4", "hsdp2x2", 4),
         ("hsdp2x2", "fsdp4", 4), ("hsdp2x2", "fsdp3", 3), ("hsdp2x2", "plain", 1)]


@pytest.mark.parametrize("src,dst,world", LOADS, ids=[f"{s}-to-{d}" for s, d, _ in LOADS])
def test_load_into_another_layout_is_bit_exact(saved, src, dst, world):
    path, at_save, _ = saved[src]
    results = run_ranks(_load_and_continue, world, dst, path, 0, timeout=90)
    for rank, r in enumerate(results):
        assert_equal_states(r["loaded"], at_save, f"{src} -> {dst} rank {rank}")
        assert r["step"] == SAVE_STEPS and r["lr_ok"], (r["step"], r["lr_ok"])
        assert r["stats"].bytes_needed > 0 and r["stats"].bytes_read == r["stats"].bytes_needed, r["stats"]
    total = sum(v.numel() * v.element_size() for v in at_save.values())
    assert sum(r["stats"].bytes_verified for r in results) == total, "each saved byte is checksummed once"


def test_training_after_load_continues_as_uninterrupted(saved):
    """Same layout in new processes: bit-exact. Other layouts: within TOL (their gradient sums
    run in another order), from a bit-exact starting point."""
    path, _, uninterrupted = saved["fsdp4"]
    (same, *_) = run_ranks(_load_and_continue, 4, "fsdp4", path, MORE_STEPS, timeout=90)
    assert_equal_states(same["final"], uninterrupted, "fsdp4 -> fsdp4 after training")
    for layout, world in (("fsdp2", 2), ("plain", 1)):
        (other, *_) = run_ranks(_load_and_continue, world, layout, path, MORE_STEPS, timeout=90)
        for k, want in uninterrupted.items():
            err = ((other["final"][k] - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
            assert err <= TOL, f"fsdp4 -> {layout}: '{k}' differs by {err:.2e} after {MORE_STEPS} steps"


# -- every dtype and placement ------------------------------------------------------------------

def mixed_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "zero_d": torch.randn((), generator=g), "int": torch.randint(-9, 9, (7, 3), generator=g),
        "bool": torch.rand(5, generator=g) > 0.5, "bf16": torch.randn(6, 4, generator=g).bfloat16(),
        "empty": torch.empty(0, 3), "u8": torch.randint(0, 255, (3, 2), generator=g, dtype=torch.uint8),
        "s1": torch.randn(5, 7, generator=g), "s0s1": torch.randn(7, 9, generator=g),
        "strided": torch.randn(11, 3, generator=g), "bf16_s0": torch.randn(6, 5, generator=g).bfloat16(),
        "int_s0": torch.randint(0, 100, (9,), generator=g), "bool_s0": torch.rand(6, 2, generator=g) > 0.5,
        "empty_s0": torch.empty(0, 4), "zero_d_repl": torch.randn((), generator=g),
        "repl": torch.randn(3, 3, generator=g), "small": torch.randn(2, 3, generator=g),
        "strided1d": torch.randn(13, 2, generator=g),
    }


def mixed_placements(world_size: int) -> dict[str, tuple]:
    """``{key: (mesh shape, placements)}`` for the DTensors of `mixed_full` on ``world_size`` ranks."""
    one, two = (world_size,), ((2, world_size // 2) if world_size % 2 == 0 else (1, world_size))
    return {
        "s1": (one, [Shard(1)]), "s0s1": (two, [Shard(0), Shard(1)]),
        "strided": (two, [_StridedShard(0, split_factor=2), Shard(0)]), "bf16_s0": (one, [Shard(0)]),
        "int_s0": (two, [Replicate(), Shard(0)]), "bool_s0": (one, [Shard(0)]), "empty_s0": (one, [Shard(0)]),
        "zero_d_repl": (one, [Replicate()]), "repl": (two, [Replicate(), Replicate()]), "small": (one, [Shard(0)]),
        "strided1d": (one, [_StridedShard(0, split_factor=2)]),  # rows of 2 chunks: several boxes per rank
    }


def mixed_state(world_size: int, swap: bool = False) -> dict:
    """`mixed_full` as a state: DTensors on this world (``swap`` exchanges Shard(0)/Shard(1)
    where both fit), zeros everywhere when ``swap`` so that loading has to fill every value."""
    from torch.distributed.device_mesh import init_device_mesh

    fulls = mixed_full()
    state = {}
    meshes = {}
    for key, t in fulls.items():
        t = torch.zeros_like(t) if swap else t
        spec = mixed_placements(world_size).get(key) if dist.is_initialized() else None
        if spec is None:
            state[key] = t
            continue
        shape, placements = spec
        if swap and key in ("s1", "bf16_s0"):
            placements = [Shard(0)] if key == "s1" else [Shard(1)]
        if swap and key == "s0s1":
            placements = [Shard(1), Shard(0)]
        if shape not in meshes:
            meshes[shape] = init_device_mesh("cpu", shape)
        state[key] = distribute_tensor(t, meshes[shape], placements, src_data_rank=None)
    return {"tensors": state, "note": "mixed"}


def _save_mixed(rank, world_size, path):
    from shardwise.checkpoint._geometry._boxes import local_boxes

    state = mixed_state(world_size)
    got = full(state["tensors"])
    save(state, path)
    if rank == 0 and world_size > 1:  # rows [0, 2) and [7, 9) of 13 on 4 ranks
        assert len(local_boxes(state["tensors"]["strided1d"])) == 2, "a strided shard is saved as two boxes"
    return got


def _load_mixed(rank, world_size, path):
    state = mixed_state(world_size, swap=True)
    load(state, path)
    return full(state["tensors"]), state["note"]


def test_every_dtype_and_placement_round_trips(tmp_path):
    want = mixed_full()
    held = run_ranks(_save_mixed, 4, str(tmp_path / "mixed"), timeout=90)
    for rank, got in enumerate(held):  # the DTensors really hold what we think
        assert_equal_states(got, want, f"saving rank {rank}")
    for world in (1, 2, 3):
        for rank, (got, note) in enumerate(run_ranks(_load_mixed, world, str(tmp_path / "mixed"), timeout=90)):
            assert note == "mixed"
            assert_equal_states(got, want, f"load into {world} ranks, rank {rank}")
