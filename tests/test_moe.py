"""The `MoE` layer in one process: routing, the router's losses by their definitions, the
capacity drops, and the outputs against a per-token loop; the dispatch permutation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.composable import MoE, TopKRouter, load_balancing_loss, router_z_loss
from shardwise.composable._moe._dispatch import regroup_index

TOL = {"rtol": 1e-6, "atol": 1e-6}


def _per_token(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """An independent loop: each token, each chosen expert, in token order, with the capacity
    counted by hand."""
    r = moe.router
    logits = x @ r.gate.weight.t()
    scores = logits.softmax(-1) if r.score_func == "softmax" else logits.sigmoid()
    cap = math.inf if moe.capacity_factor is None else math.ceil(
        moe.capacity_factor * x.shape[0] * moe.top_k / moe.num_experts)
    taken = [0] * moe.num_experts
    out, dropped = torch.zeros_like(x), 0
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    for t in range(x.shape[0]):
        top, idx = scores[t].topk(moe.top_k)
        if r.norm_topk_prob:
            top = top / top.sum()
        for w, e in zip(top * r.route_scale, idx.tolist()):
            if taken[e] >= cap:
                dropped += 1
                continue
            taken[e] += 1
            out[t] += w * (w2[e] @ (F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])))
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x)
    return out, dropped / (x.shape[0] * moe.top_k)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(score_func="sigmoid", route_scale=2.5), dict(norm_topk_prob=False, shared_hidden=6),
    dict(capacity_factor=0.5), dict(capacity_factor=1.25, top_k=1)], ids=str)
def test_moe_matches_a_per_token_loop(kwargs):
    torch.manual_seed(0)
    moe = MoE(6, 10, num_experts=5, **{"top_k": 2, **kwargs})
    x = torch.randn(2, 9, 6)
    with torch.no_grad():
        got = moe(x)
        want, dropped = _per_token(moe, x.reshape(-1, 6))
    torch.testing.assert_close(got, want.reshape(2, 9, 6), **TOL)
    assert moe.stats.dropped_fraction == pytest.approx(dropped)
    if kwargs.get("capacity_factor") == 0.5:
        assert dropped > 0.2, "half capacity must drop"
    assert int(moe.stats.tokens_per_expert.sum()) == 18 * moe.top_k


def test_load_balancing_loss_definition():
    probs = torch.softmax(torch.randn(7, 4), -1)
    experts = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 0], [2, 3], [3, 1], [0, 2]])
    f = torch.tensor([sum(int(e in row) for row in experts.tolist()) / 7 for e in range(4)])
    want = 4 * (f * probs.mean(0)).sum()
    torch.testing.assert_close(load_balancing_loss(probs, experts), want)
    # uniform routing: the loss is k
    uniform = torch.full((8, 4), 0.25)
    assert load_balancing_loss(uniform, torch.tensor([[i % 4, (i + 1) % 4] for i in range(8)])).item() == 2.0


def test_sequence_load_balancing_loss_is_each_sequences_own_and_microbatch_invariant():
    torch.manual_seed(0)
    moe = MoE(6, 10, num_experts=5, top_k=2)
    x = torch.randn(4, 7, 6)
    moe(x)
    per_seq = moe.seq_aux_loss
    assert per_seq.shape == (4,)
    for b in range(4):  # the batch-wise loss of one sequence alone
        moe(x[b:b + 1])
        torch.testing.assert_close(per_seq[b], moe.aux_loss, **TOL)
    halves = []
    for part in x.split(2):  # two microbatches: the mean over sequences is unchanged
        moe(part)
        halves.append(moe.seq_aux_loss)
    torch.testing.assert_close(torch.cat(halves).mean(), per_seq.mean(), **TOL)
    moe(x.reshape(-1, 6))
    assert moe.seq_aux_loss is None, "a 2-D input has no sequences"


def test_router_z_loss_definition():
    z = torch.randn(5, 3)
    want = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in z.tolist()) / 5
    assert router_z_loss(z).item() == pytest.approx(want, rel=1e-6)


def test_router_losses_have_gradients():
    torch.manual_seed(0)
    moe = MoE(4, 8, num_experts=4, top_k=2)
    moe(torch.randn(10, 4))
    (moe.aux_loss + moe.z_loss).backward()
    assert moe.router.gate.weight.grad is not None and moe.router.gate.weight.grad.abs().sum() > 0


def test_sigmoid_router_probabilities_sum_to_one():
    r = TopKRouter(4, 6, 2, score_func="sigmoid")
    routing = r(torch.randn(3, 4))
    torch.testing.assert_close(routing.probs.sum(-1), torch.ones(3))
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(3))


def test_bad_arguments():
    with pytest.raises(ValueError, match="score_func='relu'"):
        TopKRouter(4, 4, 2, score_func="relu")
    with pytest.raises(ValueError, match="top_k=5 must be in 1..num_experts"):
        TopKRouter(4, 4, 5)
    with pytest.raises(ValueError, match="capacity_factor=0"):
        MoE(4, 4, 4, 2, capacity_factor=0)


@settings(deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=3, max_size=3), min_size=1, max_size=4))
def test_regroup_index_orders_by_local_expert_then_source(recv):
    labels = [(s, j) for s, row in enumerate(recv) for j, n in enumerate(row) for _ in range(n)]
    index = regroup_index(recv)
    assert sorted(index) == list(range(len(labels))), "a permutation"
    regrouped = [labels[i] for i in index]
    assert regrouped == sorted(labels, key=lambda sj: (sj[1], sj[0]))
