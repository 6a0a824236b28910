"""The planner's options: `PlanOptions` / `MeshOptions` give the same plans as the keyword forms
(which stay), `plan_memory` returns a `MemoryPlan` for every ``pp`` (a pipeline's is the
`PipelineMemoryPlan`, whose own figures are its worst stage's), and a keyword that is not an
option fails."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields

import pytest
import torch

from examples.model import Llama, LlamaConfig
from shardwise.composable import (MemoryPlan, MeshOptions, MixedPrecisionPolicy, PipelineMemoryPlan, PlanOptions,
                                  plan_memory, plan_pipeline_memory, suggest_mesh)


def _meta_llama():
    with torch.device("meta"):
        return Llama(LlamaConfig(vocab_size=1000, dim=64, n_layers=8, n_heads=4))


def test_options_and_keywords_plan_the_same():
    model, bf16 = _meta_llama(), MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = dict(mp_policy=bf16, activation_bytes=2**20, optimizer_states=1, prefetch=1)
    opts = PlanOptions("SHARD_GRAD_OP", **kw)
    flat = plan_memory(model, (1, 4), opts)
    assert type(flat) is MemoryPlan and flat == plan_memory(model, (1, 4), "SHARD_GRAD_OP", **kw)
    assert plan_memory(model, (1, 4), opts, prefetch=2) == plan_memory(model, (1, 4), "SHARD_GRAD_OP",
                                                                       **{**kw, "prefetch": 2})  # keywords override
    assert plan_memory(model, 4) == plan_memory(model, 4, PlanOptions())
    with pytest.raises(FrozenInstanceError):
        opts.cp = 2  # type: ignore[misc]
    with pytest.raises(TypeError, match="bogus"):
        plan_memory(model, 4, bogus=1)


def test_a_pipeline_plan_is_a_memory_plan_of_its_worst_stage():
    model = _meta_llama()
    opts = PlanOptions(activation_bytes=64 * 2**20, pp=2, microbatches=8, schedule="gpipe")
    pipe = plan_memory(model, (1, 2), opts)
    assert isinstance(pipe, MemoryPlan) and isinstance(pipe, PipelineMemoryPlan)
    assert pipe == plan_pipeline_memory(model, (1, 2), opts)
    assert pipe == plan_memory(model, (1, 2), "FULL_SHARD", activation_bytes=64 * 2**20, pp=2, microbatches=8,
                               schedule="gpipe")
    worst = pipe.stages[pipe.worst_stage]
    assert all(getattr(pipe, f.name) == getattr(worst, f.name) for f in fields(MemoryPlan))
    assert pipe.peak == worst.peak == max(s.peak for s in pipe.stages)
    assert str(pipe).startswith("pipeline pp=2, gpipe")


def test_mesh_options_and_keywords_suggest_the_same():
    model = _meta_llama()
    kw = dict(activation_bytes=2 * 2**30, pp_sizes=(1, 2), microbatches=8, headroom=0.8)
    a = suggest_mesh(model, 2, 1, 2**30, MeshOptions(**kw))
    b = suggest_mesh(model, hosts=2, gpus_per_host=1, bytes_per_gpu=2**30, **kw)
    assert a == b and a.pp == 2 and type(a.plan) is MemoryPlan
    assert MeshOptions().microbatches == 8 and PlanOptions().microbatches == 1  # as the old defaults
    with pytest.raises(TypeError, match="bogus"):
        suggest_mesh(model, 2, 1, 2**30, bogus=1)
