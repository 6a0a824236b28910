"""The public faces: ``shardwise.composable.{fsdp,tp,pipeline,cp,moe}`` each name their
user-facing names in ``__all__``, and every name ``shardwise.composable`` exported before the
faces (its ``__all__`` of that commit, listed here by hand so the list cannot shrink with the
code) is still importable from it."""

from __future__ import annotations

import importlib

import pytest

import shardwise.composable as composable

# shardwise.composable.__all__ before the faces: 112 names (81 of its own, 31 of _pipeline.__all__)
BEFORE_FACES = """
AccelerateConfig Action ActionKind AllGather ApplyContext CPUOffloadPolicy ColwiseParallel DEFAULT_KEPT_GRADS
DEFAULT_REGISTRY DataParallelMeshDims DispatchStats ExpertParallel ExpertTensorParallel FSDPModule
FullyShardUsageError GroupedExperts InFlight LayoutsMismatchError METHODS MemoryPlan MeshSuggestion
MixedPrecisionPolicy MoE MoEStats ModuleParallel ModuleRule NoMeshError OffloadPolicy PLACEMENTS PairHalves
ParallelStyle PipelineError PipelineSchedule PipelineSplit PlanError PlanTypeError PlanWarning PositionsHandle
PrepareModuleInput PrepareModuleInputOutput PrepareModuleOutput RUNNABLE_KINDS ReduceScatter ReplicateModule
RouteHandle Routing RowwiseParallel SCHEDULES ScheduleSpec SequenceParallel ShardingPolicy ShardingStrategy
SharedExperts StagePlan TPRegistry TUNABLE_SCHEDULES TopKRouter UnitPlan UnshardHandle UnsupportedModuleTypeError
activations_in_flight apply_fully_shard balanced_bounds broadcast_from_rank0 build_schedule clip_grad_norm_
context_parallel context_parallel_attention expert_parallel_plan feed_positions from_accelerate_config fully_shard
fully_shard_experts get_schedule load_balancing_loss local_shard_range loss_parallel materialize moe_from_hf
parallelize_module pipeline_optimizer_state_dict pipeline_split pipeline_state_dict plan_memory plan_stages
register_fsdp_forward_method register_schedule replicate retune route_attention router_z_loss select_units
sequence_load_balancing_loss set_pipeline_optimizer_state_dict set_pipeline_state_dict shard_sequence
share_comm_ctx simulate stage_rank strategy_mesh suggest_mesh swap_hf_moe_blocks theoretical_bubble
to_local_share token_mean_loss tune_schedule uniform_bounds unregister_schedule unshard_sequence
vocab_parallel_cross_entropy zigzag_chunks zigzag_positions
""".split()
FACES = ("fsdp", "tp", "pipeline", "cp", "moe", "optim")
PLANNER = {"plan_memory", "plan_pipeline_memory", "suggest_mesh", "PlanOptions", "MeshOptions", "MemoryPlan",
           "PipelineMemoryPlan", "MeshSuggestion", "UnitPlan", "DEFAULT_KEPT_GRADS"}


def test_every_name_exported_before_the_faces_is_still_importable():
    assert len(BEFORE_FACES) == len(set(BEFORE_FACES)) == 112
    missing = [n for n in BEFORE_FACES if not hasattr(composable, n)]
    assert not missing, f"shardwise.composable no longer has {missing}"
    ns: dict = {}
    exec(f"from shardwise.composable import {', '.join(BEFORE_FACES)}", ns)  # the way user code imports them


@pytest.mark.parametrize("face", FACES)
def test_each_face_names_resolve_to_the_flat_names(face):
    mod = importlib.import_module(f"shardwise.composable.{face}")
    assert getattr(composable, face) is mod
    assert mod.__all__ and len(mod.__all__) == len(set(mod.__all__))
    for name in mod.__all__:
        assert getattr(mod, name) is getattr(composable, name), name  # one object, two addresses


def test_the_flat_all_is_the_faces_and_the_planner():
    faces = [n for f in FACES for n in importlib.import_module(f"shardwise.composable.{f}").__all__]
    assert len(faces) == len(set(faces)), "a name in two faces"
    assert sorted(composable.__all__) == sorted(set(faces) | PLANNER)
    # names before the faces left out of __all__: importable (above), but below the faces' level
    assert sorted(set(BEFORE_FACES) - set(composable.__all__)) == [
        "InFlight", "PLACEMENTS", "RUNNABLE_KINDS", "balanced_bounds", "uniform_bounds"]
