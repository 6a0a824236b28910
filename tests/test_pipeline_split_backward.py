"""The split backward ([Note: split backward] in composable/_pipeline/_split/_split_backward.py): ``I`` then ``W``
give exactly the gradients of one full backward (hypothesis over shapes), ``I`` computes no parameter
gradient (a reentrant checkpoint excepted), for keyword arguments, non-reentrant and reentrant activation
checkpointing, frozen and tied parameters, and a module reused inside the stage (the exact fallback)."""

from __future__ import annotations

import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

from shardwise.composable._pipeline._split._split_backward import input_grad, weight_grad


class Stage(nn.Module):
    """Two linears, a norm and an attention-like mix, with a keyword argument (``scale``)."""

    def __init__(self, d: int, hidden: int, *, ac: str = "", tie: bool = False, frozen: bool = False,
                 reuse: bool = False) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.norm = nn.LayerNorm(d)
        self.mix = nn.Linear(d, d, bias=False)
        if tie:
            self.mix.weight = self.down.weight if hidden == d else self.mix.weight
            self.up.weight = self.mix.weight if hidden == d else self.up.weight
        if frozen:
            self.up.bias.requires_grad_(False)
            self.norm.weight.requires_grad_(False)
        self.ac, self.reuse = ac, reuse

    def block(self, h, scale=None, mask=None):
        a = torch.softmax((h @ self.mix(h).transpose(-1, -2)).masked_fill(mask, -1e4), -1) @ h
        h = h + self.down(torch.tanh(self.up(self.norm(a)))) * scale
        return h

    def forward(self, h, *, scale, mask):
        if self.ac:
            h = checkpoint(self.block, h, scale, mask, use_reentrant=self.ac == "reentrant")
        else:
            h = self.block(h, scale, mask)
        return self.norm(h) if self.reuse else h


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@settings(deadline=None, max_examples=40)
@given(b=st.integers(1, 3), t=st.integers(1, 5), d=st.integers(1, 6), hidden=st.integers(1, 7),
       variant=st.sampled_from(["", "ac", "reentrant", "tie", "frozen", "reuse"]), last=st.booleans(),
       micro=st.integers(1, 3))
def test_input_then_weight_gradients_equal_one_full_backward(b, t, d, hidden, variant, last, micro):
    torch.manual_seed(b * 100 + t * 10 + d)
    m = Stage(d, hidden if variant != "tie" else d, ac="non-reentrant" if variant == "ac" else
              "reentrant" if variant == "reentrant" else "", tie=variant == "tie", frozen=variant == "frozen",
              reuse=variant == "reuse").double()
    xs = [torch.randn(b, t, d, dtype=torch.float64) for _ in range(micro)]
    gs = [torch.randn(b, t, d, dtype=torch.float64) for _ in range(micro)]
    scale = torch.randn(d, dtype=torch.float64)
    mask = torch.rand(t, t) > 0.7

    def out(x):
        y = m(x, scale=scale, mask=mask)
        return y.square().mean() if last else y

    ref_x = []
    for x, g in zip(xs, gs):  # the reference: one full backward per microbatch
        x = x.clone().requires_grad_()
        torch.autograd.backward([out(x)], None if last else [g])
        ref_x.append(x.grad)
    ref = _grads(m)
    m.zero_grad(set_to_none=True)
    kept = []
    for x, g in zip(xs, gs):  # every I first (all microbatches alive), then every W
        x = x.clone().requires_grad_()
        gx, pending = input_grad([out(x)], [None if last else g], x)
        if variant != "reentrant":
            assert all(p.grad is None for p in m.parameters()), "I computed parameter gradients"
        assert pending.exact == (variant not in ("reuse",)) or variant == "reentrant", pending.exact
        kept.append((x, pending, gx))
    for (x, pending, gx), rx in zip(kept, ref_x):
        assert torch.equal(gx, rx) or torch.allclose(gx, rx, rtol=1e-12, atol=1e-12)
        weight_grad(pending, x)
    got = _grads(m)
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-12, atol=1e-12, msg=n)


def test_first_stage_weight_is_the_full_backward():
    """No stage input (x is None): I does nothing, W is the whole backward."""
    m = Stage(3, 4)
    x = torch.randn(2, 3, 3)
    kw = {"scale": torch.ones(3), "mask": torch.zeros(3, 3, dtype=torch.bool)}
    m(x, **kw).sum().backward()
    ref = _grads(m)
    m.zero_grad(set_to_none=True)
    gx, pending = input_grad([m(x, **kw).sum()], [None], None)
    assert gx is None and all(p.grad is None for p in m.parameters())
    weight_grad(pending, None)
    got = _grads(m)
    assert set(got) == set(ref) and all(torch.allclose(got[n], ref[n]) for n in ref)
