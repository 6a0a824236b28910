"""One training step under ``torch.profiler.profile`` shows every unit's collective phases as
named ranges ``shardwise::<phase>[<unit path>]`` (issue 14.5; see "Reading a trace of one
step" in docs/fully_shard.md)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from shardwise.composable import fully_shard
from tests._dist import run_ranks
from tests._models import batches, loss_fn, make_mesh, reference_and_copy


def _ranges_of_one_step(rank, world_size, mesh_shape):
    mesh = make_mesh(mesh_shape)
    _, model = reference_and_copy()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    tokens, target = batches(1, 4)[0]
    loss_fn(model(tokens), target).backward()  # first step: lazy init names the units
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_fn(model(tokens), target).backward()
    return sorted({e.name for e in prof.events() if e.name.startswith("shardwise::")})


def _expected(units, phases):
    return sorted(f"shardwise::{p}[{u}]" for u in units for p in phases)


def test_a_step_shows_named_ranges_per_unit_and_phase():
    units = ("root", "blocks.0", "blocks.1")
    # FSDP on 2 ranks: the root keeps its parameters after forward (one all-gather), the blocks
    # all-gather in forward and again in backward; every unit reduce-scatters; no all-reduce
    want = _expected(units, ("all_gather", "all_gather_wait", "copy_out", "reduce_scatter"))
    for rank, names in enumerate(run_ranks(_ranges_of_one_step, 2, (2,))):
        assert names == want, f"rank {rank}: profiler ranges {names}, want {want}"


def test_hsdp_step_shows_the_replicate_all_reduce():
    units = ("root", "blocks.0", "blocks.1")
    want = _expected(units, ("all_gather", "all_gather_wait", "copy_out", "reduce_scatter", "all_reduce"))
    for rank, names in enumerate(run_ranks(_ranges_of_one_step, 4, (2, 2))):
        assert names == want, f"rank {rank}: profiler ranges {names}, want {want}"
