"""plan_memory(pp=N): the head's and embedding's activations on their stages (``tokens``), and the
gradients a stage holds at once after its first backward (``held_grads``); pure, no processes.
See [Note: the memory of a pipeline stage] in composable/_plan/_pipeline.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from shardwise.composable import activations_in_flight, build_schedule, plan_memory
from shardwise.composable._plan._stage_terms import before_and_after_first_backward, end_terms

V, D, T, A = 1000, 64, 512, 64 * 2**20


def _meta_llama(**kw):
    from examples.model import Llama, LlamaConfig
    with torch.device("meta"):
        return Llama(LlamaConfig(**kw))


def test_end_terms_from_shapes() -> None:
    """Head: the logits and the loss's log-softmax (V each), the final norm's two D-wide tensors;
    one V is the logits (their gradient in backward), alive for one microbatch at a time."""
    model = _meta_llama(vocab_size=V, dim=D, n_layers=2, n_heads=4)
    ends = end_terms([model.tok_embeddings], [model.norm, model.output], T)
    assert (ends.head_kept, ends.head_transient, ends.embedding) == (T * (V + 2 * D) * 4, T * V * 4, T * D * 4)
    assert ends.total == T * (2 * V + 3 * D) * 4
    half = end_terms([model.tok_embeddings], [model.norm, model.output], T, torch.bfloat16, tp=2)
    assert (half.head_kept, half.head_transient, half.embedding) == (T * (V + 2 * D), T * V, T * D)
    assert end_terms([model.tok_embeddings], [model.norm, model.output], None).total == 0
    assert end_terms([], [model.norm], T).total == 0  # no projection, no embedding: nothing to place
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="tokens="):
            end_terms([], [model.output], bad)


def test_the_head_is_planned_on_the_last_stage_and_the_embedding_on_the_first() -> None:
    model = _meta_llama(vocab_size=V, dim=D, n_layers=8, n_heads=4)
    ends = end_terms([model.tok_embeddings], [model.norm, model.output], T)
    for schedule, m in (("1f1b", 8), ("zb_h1", 8), ("gpipe", 1)):
        kw = dict(activation_bytes=A, pp=2, microbatches=m, schedule=schedule, reduce_every_microbatch=True)
        plan = plan_memory(model, (1, 2), "FULL_SHARD", tokens=T, **kw)
        spread = plan_memory(model, (1, 2), "FULL_SHARD", **kw)
        assert plan.in_flight == spread.in_flight and plan.head_activations == ends.head_kept + ends.head_transient
        assert plan.embedding_activations == ends.embedding and "head + loss" in str(plan) and "head" not in str(spread)
        block = (A - ends.total) / 8
        n = [plan.bounds[s + 1] - plan.bounds[s] for s in range(2)]
        units = activations_in_flight(schedule, 2, m, kept_grads=plan.kept_grads).per_rank  # one stage per rank
        want = [(block * n[0] + ends.embedding) * units[0] / m,
                (block * n[1] + ends.head_kept) * units[1] / m + ends.head_transient / m]
        assert [st.activations for st in plan.stages] == pytest.approx(want, abs=2), (schedule, plan)
        assert [st.activations for st in spread.stages] == pytest.approx([A * n[s] / 8 * units[s] / m for s in range(2)],
                                                                         abs=2)
    # a large vocabulary: the last stage holds more than its share of blocks, the first less
    assert plan.stages[1].activations > spread.stages[1].activations
    assert plan.stages[0].activations < spread.stages[0].activations
    big = plan_memory(model, (1, 2), "FULL_SHARD", activation_bytes=0, pp=2, microbatches=4, tokens=T)
    assert big.stages[1].activations > 0 and big.stages[0].activations == ends.embedding * 2 // 4  # no blocks' part


def test_gradients_held_at_once_after_the_first_backward() -> None:
    """From a stage's second backward on every unit holds its summed gradients (the largest's too,
    which start_of_backward did not count) while a new one is computed: at most one unit's, in a
    full backward and in a split backward's W (which adds its gradients in bounded batches)."""
    model = _meta_llama(vocab_size=V, dim=D, n_layers=8, n_heads=4)
    for schedule in ("1f1b", "zb_h1"):
        plan = plan_memory(model, (1, 2), "FULL_SHARD", pp=2, microbatches=8, schedule=schedule)
        for s, st in enumerate(plan.stages):
            grads = [u.unsharded_grads for u in st.units]
            largest = max(st.units[:-1], key=lambda u: u.unsharded).unsharded_grads
            assert st.held_grads == largest + max(grads), (schedule, s, st)
        big = plan_memory(model, (1, 2), "FULL_SHARD", pp=2, microbatches=8, schedule=schedule, activation_bytes=A)
        assert all(st.peak - replace(st, held_grads=0).peak == st.held_grads > 0 for st in big.stages)
    for kw in (dict(microbatches=1), dict(microbatches=8, reduce_every_microbatch=True)):
        assert all(st.held_grads == 0 for st in plan_memory(model, (1, 2), "FULL_SHARD", pp=2, **kw).stages)
    # GPipe peaks before its first backward, with m microbatches and no summed gradients yet
    gp = plan_memory(model, (1, 2), "FULL_SHARD", pp=2, microbatches=8, schedule="gpipe", activation_bytes=A)
    assert all(st.held_grads == 0 for st in gp.stages)
    assert [st.activations for st in gp.stages] == pytest.approx([A * (gp.bounds[s + 1] - gp.bounds[s]) / 8
                                                                  for s in range(2)], abs=2)
    small = plan_memory(model, (1, 2), "FULL_SHARD", pp=2, microbatches=8, schedule="gpipe", activation_bytes=8)
    assert all(st.held_grads > 0 for st in small.stages)  # later: 7 of 8 alive, all gradients held


def test_activations_before_and_after_the_first_backward() -> None:
    acts = {name: build_schedule(name, 2, 4) for name in ("gpipe", "1f1b", "zb_h1")}
    f = before_and_after_first_backward
    assert [f(acts["gpipe"][r], {r: 1.0}, 0.0) for r in range(2)] == [(4, 3), (4, 3)]
    assert [f(acts["1f1b"][r], {r: 1.0}, 0.0) for r in range(2)] == [(2, 2), (1, 1)]
    # zb_h1's last rank: F I F I before its first W, then F I after each W; stage 0's I keeps nothing
    assert [f(acts["zb_h1"][r], {r: 2.0}, 0.5) for r in range(2)] == [(4, 4), (6, 6)]
    assert f(acts["gpipe"][0][:4], {0: 1.0}, 0.0) == (4, 0)  # no backward at all


def test_suggest_mesh_takes_tokens() -> None:
    from shardwise.composable import suggest_mesh
    model = _meta_llama(vocab_size=8 * V, dim=D, n_layers=8, n_heads=4)  # the head's activations decide
    kw = dict(hosts=2, gpus_per_host=1, bytes_per_gpu=2**30, activation_bytes=A, pp_sizes=(2,), microbatches=8)
    with_tokens, without = suggest_mesh(model, tokens=T, **kw), suggest_mesh(model, **kw)
    worst = plan_memory(model, (1, 1), "NO_SHARD", activation_bytes=A, pp=2, microbatches=8, tokens=T)
    assert worst.worst_stage == 1 and with_tokens.plan == worst.stages[1], (with_tokens, worst)
    assert without.plan.peak != with_tokens.plan.peak  # spread with the blocks, stage 0 (2 alive) was the worst
