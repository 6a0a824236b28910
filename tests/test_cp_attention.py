"""Context-parallel attention against one process's ``scaled_dot_product_attention``.

Every rank builds the same global q, k, v and upstream gradient from a seed, computes SDPA
and its gradients on the whole sequence (the reference), then its zigzag shard's output and
gradients through the cp ring (or the all-gather variant); the rows must agree. Cases
(sequence length, heads, GQA groups, causal or not) are drawn by hypothesis, several per
multi-rank call. Tolerance: fp32 1e-6 of the largest reference value (``rel``) for the
output; ``FP32_GRAD`` = 2e-6 for dq / dk / dv, because a key's gradient is a sum over up to
``2 cp`` query blocks, accumulated around the ring in another order than SDPA's single pass
(each partial rescaled by its log-sum-exp): at cp 4 that is 8 rounded fp32 partial sums, and
hypothesis found a dv 1.008e-6 away (40 tokens, 2 heads, not causal) in a clean-clone CI run;
bf16 is compared in the dtype's own precision (2e-2: 8 bits of mantissa).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
import torch
import torch.nn.functional as F

from shardwise.composable import context_parallel_attention, shard_sequence, zigzag_positions
from shardwise.composable._cp import _block, _compat
from shardwise.composable._cp._layout import block_plan
from tests._dist import run_ranks

FP32, FP32_GRAD, BF16 = 1e-6, 2e-6, 2e-2  # see the module docstring


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _case(rank, cp, case, method, group=None):
    seq, heads, groups, causal, dtype, seed = case
    g = torch.Generator().manual_seed(seed)
    B, D, kv_heads = 2, 8, heads // groups
    q, k, v = (torch.randn(B, h, seq, D, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    do = torch.randn(B, heads, seq, D, generator=g).to(dtype)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=causal, enable_gqa=groups > 1)
    ref.backward(do)
    mine = [shard_sequence(t, rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*mine, group, is_causal=causal, method=method)
    out.backward(shard_sequence(do, rank, cp, dim=2))
    errs = {"out": rel(out, shard_sequence(ref, rank, cp, dim=2)), "dtype_ok": out.dtype == dtype}
    for name, a, r in zip("qkv", mine, ref_in):
        errs["d" + name] = rel(a.grad, shard_sequence(r.grad, rank, cp, dim=2))
    return errs


def _cases(rank, world_size, cases, method, kernel="auto"):
    _block.KERNEL = kernel  # this rank process only
    return [_case(rank, world_size, c, method) for c in cases]


case_st = st.tuples(st.sampled_from([1, 2, 3, 5]),  # chunk length: seq = 2 * cp * this
                    st.sampled_from([2, 4]), st.sampled_from([1, 2]), st.booleans(),
                    st.just(torch.float32), st.integers(0, 2**16))


def _check(results, cases):
    for rank, per_rank in enumerate(results):
        for case, errs in zip(cases, per_rank):
            fp32 = case[4] == torch.float32
            assert errs.pop("dtype_ok"), (rank, case)
            assert all(e <= (BF16 if not fp32 else FP32 if k == "out" else FP32_GRAD) for k, e in errs.items()), \
                (rank, case, errs)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", ["ring", "allgather"])
@settings(max_examples=2, deadline=None)
@given(raw=st.lists(case_st, min_size=3, max_size=3))
def test_matches_sdpa_fp32(cp, method, raw):
    cases = [(2 * cp * n, h, gq, c, dt, s) for n, h, gq, c, dt, s in raw]
    _check(run_ranks(_cases, cp, cases, method, timeout=120), cases)


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_matches_sdpa_bf16_and_gqa(method):
    cases = [(16, 4, 2, True, torch.bfloat16, 1), (16, 4, 4, False, torch.bfloat16, 2), (8, 6, 3, True,
                                                                                         torch.float32, 3)]
    _check(run_ranks(_cases, 2, cases, method, timeout=120), cases)


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_math_kernel_matches_sdpa(method):
    """The float32 matmul blocks (used off CPU, and the fused kernel's reference)."""
    cases = [(16, 4, 2, True, torch.float32, 6), (16, 2, 1, False, torch.float32, 7),
             (16, 4, 4, True, torch.bfloat16, 8)]
    _check(run_ranks(_cases, 2, cases, method, "math", timeout=120), cases)


def test_fused_kernel_is_what_the_blocks_rely_on():
    """_compat.py's fused kernel: lse is the natural-log log-sum-exp of the scaled scores
    ([B, H, T] float32, top-left causal), and its backward, given another row's output and
    lse, gives that block's share of the gradients: both equal the float32 matmul blocks."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 8, 4, generator=g) for _ in range(4))
    out = torch.randn(2, 3, 8, 4, generator=g)
    lse = torch.randn(2, 3, 8, generator=g).abs() + 3.0  # a row's lse from more keys than this block
    assert _compat.fused_available(q) and not _compat.fused_available(q.to(torch.int64))
    for causal in (False, True):
        kind = _block.DIAGONAL if causal else _block.FULL
        o_f, lse_f = _compat.fused_forward(q, k, v, 0.3, causal)
        s = (q @ k.transpose(-1, -2)) * 0.3
        if causal:
            s = s.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
        assert lse_f.dtype == torch.float32 and lse_f.shape == (2, 3, 8)
        assert rel(lse_f, torch.logsumexp(s, -1)) <= FP32 and rel(o_f, torch.softmax(s, -1) @ v) <= FP32
        fused = _compat.fused_backward(do, q, k, v, out, lse, 0.3, causal)
        old, _block.KERNEL = _block.KERNEL, "math"
        try:
            math = _block.block_backward(q, k, v, do, out, lse, (do * out).sum(-1), 0.3, kind)
        finally:
            _block.KERNEL = old
        # 1e-5: an lse from other keys makes P a non-normalised matrix; the two kernels sum its
        # products in different orders (the parity tests above hold the real rows to 1e-6)
        assert all(rel(a, b) <= 1e-5 for a, b in zip(fused, math)), [rel(a, b) for a, b in zip(fused, math)]


def test_one_rank_is_sdpa():
    """cp = 1 (the ring of one) is plain attention in this process, no communication."""
    cases = [(6, 2, 2, True, torch.float32, 4), (6, 2, 1, False, torch.float32, 5)]
    _check(run_ranks(_cases, 1, cases, "ring", timeout=60), cases)


@settings(max_examples=60, deadline=None)
@given(cp=st.integers(1, 6), causal=st.booleans(), data=st.data())
def test_block_plan_covers_exactly_the_visible_pairs(cp, causal, data):
    """Every (query chunk, key chunk) pair the mask lets through is computed exactly once,
    with the triangular mask exactly on the diagonal pairs; masked pairs are never computed."""
    r, s = data.draw(st.integers(0, cp - 1)), data.draw(st.integers(0, cp - 1))
    qc, kc = (r, 2 * cp - 1 - r), (s, 2 * cp - 1 - s)
    seen = []
    for qs, ks, diag in block_plan(qc, kc, causal):
        for qi in ((0, 1) if qs is None else (qs,)):
            for ki in ((0, 1) if ks is None else (ks,)):
                seen.append((qc[qi], kc[ki], diag))
    want = [(a, b, causal and a == b) for a in qc for b in kc if not causal or b <= a]
    assert sorted(seen) == sorted(want)


def test_zigzag_balances_causal_work():
    """Each rank computes the same number of visible chunk pairs: 2cp + 1 (two half-masked)."""
    for cp in (1, 2, 3, 4, 8):
        for r in range(cp):
            qc = (r, 2 * cp - 1 - r)
            assert sum(kc <= c for c in qc for kc in range(2 * cp)) == 2 * cp + 1
            assert torch.equal(zigzag_positions(4 * cp, r, cp),
                               torch.cat([torch.arange(2 * c, 2 * c + 2) for c in qc]))


def _ring_order(rank, world_size):
    from shardwise.composable._cp import _attention, _ring

    events = []
    real_fwd, real_bwd = _attention.block_forward, _attention.block_backward
    real_exchange, real_wait = _ring.Ring.exchange, _ring.InFlight.wait
    names = {_attention._KV_TAG: "kv", _attention._GRAD_TAG: "grad"}

    def exchange(self, send, tag):
        events.append(f"send {names[tag]}")
        flight = real_exchange(self, send, tag)
        flight.name = names[tag]
        return flight

    def wait(self):
        events.append(f"wait {self.name}")
        return real_wait(self)

    _attention.block_forward = lambda *a: (events.append("compute"), real_fwd(*a))[1]
    _attention.block_backward = lambda *a: (events.append("compute"), real_bwd(*a))[1]
    _ring.Ring.exchange, _ring.InFlight.wait = exchange, wait
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    out = context_parallel_attention(q, q, q, is_causal=False)
    fwd = list(events)
    events.clear()
    out.sum().backward()
    return fwd, events


def test_ring_posts_each_transfer_before_the_compute_it_overlaps():
    """cp = 2, one block per step: the next key/value block is sent before this step's compute
    and waited for after it; in backward the previous rank's gradient accumulator is received
    during this rank's compute of its own share."""
    for fwd, bwd in run_ranks(_ring_order, 2, timeout=60):
        assert fwd == ["send kv", "compute", "wait kv", "compute"], fwd
        assert bwd == ["send kv", "compute", "send grad", "wait kv", "compute", "wait grad", "send grad",
                       "wait grad"], bwd
