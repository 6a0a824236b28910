"""WholeMatrixOptimizer: Muon (and a user's whole-matrix optimizer) on sharded parameters, each
matrix updated whole by one owner rank, against the same optimizer on one process.

Tolerances. With the same gradients the owner runs the very same code on the very same whole
matrix, so parameters and state are bit-equal (0), for torch's bf16 Newton-Schulz and for an fp32
one (`Fp32Muon`, a user optimizer declaring the protocol) alike. Trained through backward, the
sharded gradients differ from one process's in the last bits (the reduce-scatter sums in another
order: up to 5e-7 relative here), and Newton-Schulz amplifies an input difference (its quintic
has slope up to ``a = 3.4`` at small singular values, over 5 iterations): measured 7.5e-7 after
one step and 1.3e-6 after four on the 16 x 9 matrix, so the trained fp32 comparison allows
`TRAINED_FP32_TOL` = 1e-5 (while the AdamW-updated parameters stay within 1e-6). torch's bf16
iteration rounds the iterate to 8 bits of mantissa, so a last-bit difference of the input can
flip a rounding: `BF16_TOL` = 2e-2 relative (measured below 1e-2)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from shardwise.composable import (WholeMatrixOptimizer, fully_shard, needs_whole_matrices, plan_owners,
                                  register_whole_matrix_optimizer, split_matrix_params)
from shardwise.mesh import data_parallel_mesh, init_mesh
from tests._compare import maxerr
from tests._dist import run_ranks

TRAINED_FP32_TOL = 1e-5
ELEMENTWISE_TOL = 1e-6
BF16_TOL = 2e-2


class Fp32Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update (Nesterov momentum, quintic Newton-Schulz, decoupled weight decay,
    ``adjust_lr_fn=None``) with the iteration in ``ns_dtype`` (fp32 by default): a user's
    optimizer that declares the protocol."""

    needs_whole_matrices = True

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, ns_steps=5,
                 ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_dtype=torch.float32):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps,
                                      ns_coefficients=ns_coefficients, eps=eps, ns_dtype=ns_dtype))

    @staticmethod
    def _orthogonalize(g, coefficients, steps, eps, dtype):
        a, b, c = coefficients
        x = g.to(dtype)
        tall = g.size(0) > g.size(1)
        if tall:
            x = x.T
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if tall else x

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"])
                update = self._orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                             group["ns_dtype"])
                lr = group["lr"] * math.sqrt(max(1, p.shape[0] / p.shape[1]))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-lr)


class Mats(nn.Module):
    """Matrices of uneven sizes (7 rows and 3 rows do not divide 2 or 4 ranks; 3 rows leave rank
    3 of 4 empty), an embedding, a norm and biases for the elementwise fallback."""

    def __init__(self, vocab=11, dim=12):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.a = nn.Linear(dim, 7)
        self.b = nn.Linear(7, 9, bias=False)
        self.norm = nn.LayerNorm(9)
        self.c = nn.Linear(9, 16, bias=False)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        x = torch.tanh(self.a(self.emb(tokens)))
        x = torch.tanh(self.c(self.norm(self.b(x))))
        return self.head(x)


def _shard(model, mesh):
    for m in (model.a, model.b, model.c, model.head):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _optimizers(model, cls, **kw):
    matrices, others = split_matrix_params(model)
    return (WholeMatrixOptimizer(cls, matrices, lr=0.02, weight_decay=0.01, **kw),
            torch.optim.AdamW(others, lr=1e-2))


def _batches(steps, batch=8, seq=5):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 11, (batch, seq), generator=g), torch.randn(batch, seq, 3, generator=g))
            for _ in range(steps)]


def _train(ref, model, cls, dp_rank, dp_size, steps=4, **kw):
    """Train ``ref`` (one process, ``cls`` directly) and ``model`` (sharded, through
    WholeMatrixOptimizer); the worst relative errors of the matrices and of the other parameters
    (the AdamW fallback), over the steps."""
    rm, ro = split_matrix_params(ref)
    ref_opts = [cls(rm, lr=0.02, weight_decay=0.01, **kw), torch.optim.AdamW(ro, lr=1e-2)]
    opts = _optimizers(model, cls, **kw)
    worst = [0.0, 0.0]
    matrices = {id(p) for p in split_matrix_params(model)[0]}
    per = 8 // dp_size
    for tokens, target in _batches(steps):
        ((ref(tokens) - target) ** 2).mean().backward()
        sl = slice(dp_rank * per, (dp_rank + 1) * per)
        ((model(tokens[sl]) - target[sl]) ** 2).mean().backward()
        for o in ref_opts + list(opts):
            o.step()
            o.zero_grad()
        ref_params = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            k = 0 if id(p) in matrices else 1
            worst[k] = maxerr(worst[k], _rel(_full(p), ref_params[n].detach()))
    return worst


def _mesh(world_size, hsdp=False):
    mesh = init_mesh(dp_replicate=2 if hsdp else 1, dp_shard=world_size // 2 if hsdp else world_size,
                     device_type="cpu")
    return data_parallel_mesh(mesh)


def test_plan_owners_balances_by_size_and_is_deterministic():
    plan = plan_owners([10, 10, 40, 10, 10], 2)
    assert plan.owners == (1, 1, 0, 1, 1) and plan.loads == (40, 40)
    assert plan_owners([10, 10, 40, 10, 10], 2) == plan
    assert plan_owners([5, 5, 5], 4).owners == (0, 1, 2) and plan_owners([3], 1).owners == (0,)
    assert plan.owned_by(0) == [2]


def _same_grads(rank, world_size, steps, cls_name):
    """Identical gradients set on both: the sharded step is bit-equal to the optimizer's on one
    process (torch.optim.Muon with its bf16 Newton-Schulz, or Fp32Muon), parameters and momentum."""
    mesh = _mesh(world_size)
    torch.manual_seed(0)
    ref = Mats()
    model = _shard(copy.deepcopy(ref), mesh)
    rm, _ = split_matrix_params(ref)
    mm, _ = split_matrix_params(model)
    cls, kw = {"bf16": (torch.optim.Muon, {"adjust_lr_fn": "match_rms_adamw"}), "fp32": (Fp32Muon, {})}[cls_name]
    ropt = cls(rm, lr=0.02, **kw)
    opt = WholeMatrixOptimizer(cls, mm, lr=0.02, buckets=2, **kw)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        for rp, p in zip(rm, mm):
            full = torch.randn(rp.shape, generator=g)
            rp.grad = full.clone()
            p.grad = distribute_tensor(full, p.device_mesh, p.placements)
        ropt.step()
        opt.step()
    diff = [(_full(p) - rp.detach()).abs().max().item() for rp, p in zip(rm, mm)]
    sd = opt.state_dict()
    rsd = ropt.state_dict()
    mom = [(_full(sd["state"][i]["momentum_buffer"]) - rsd["state"][i]["momentum_buffer"]).abs().max().item()
           for i in range(len(rm))]
    owned = len(opt.inner.state)
    return diff, mom, owned, len(rm)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("ns", ["bf16", "fp32"])
def test_same_gradients_bit_equal_to_one_process(world_size, ns):
    out = run_ranks(_same_grads, world_size, 3, ns)
    for diff, mom, _, _ in out:
        assert maxerr(diff) == 0.0 and maxerr(mom) == 0.0, (diff, mom)
    owned = [o for _, _, o, _ in out]
    assert sum(owned) == out[0][3], f"state on the owners only: {owned}"
    assert world_size == 1 or max(owned) < out[0][3], f"the owners are spread over the ranks: {owned}"


def _trained(rank, world_size, cls_name, hsdp):
    mesh = _mesh(world_size, hsdp)
    torch.manual_seed(0)
    ref = Mats()
    model = _shard(copy.deepcopy(ref), mesh)
    cls = {"fp32": Fp32Muon, "bf16": torch.optim.Muon}[cls_name]
    dp_rank = dist.get_rank()
    return _train(ref, model, cls, dp_rank, world_size)


@pytest.mark.parametrize("world_size,hsdp", [(2, False), (4, False), (4, True)])
def test_trained_fp32_newton_schulz(world_size, hsdp):
    errs = run_ranks(_trained, world_size, "fp32", hsdp)
    assert maxerr(e[0] for e in errs) <= TRAINED_FP32_TOL and maxerr(e[1] for e in errs) <= ELEMENTWISE_TOL, errs


def test_trained_torch_muon_bf16_within_stated_tolerance():
    errs = run_ranks(_trained, 2, "bf16", False)
    assert maxerr(e[0] for e in errs) <= BF16_TOL and maxerr(e[1] for e in errs) <= ELEMENTWISE_TOL, errs


def _fp32_muon_is_torch_muon(rank, world_size):
    torch.manual_seed(0)
    a = nn.Linear(9, 5, bias=False)
    b = copy.deepcopy(a)
    oa = torch.optim.Muon(a.parameters(), lr=0.02)
    ob = Fp32Muon(b.parameters(), lr=0.02, ns_dtype=torch.bfloat16)
    for _ in range(3):
        g = torch.randn(5, 9)
        a.weight.grad, b.weight.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    return torch.equal(a.weight, b.weight)


def test_the_fp32_test_optimizer_is_torch_muon_in_bf16():
    """`Fp32Muon` with a bf16 iteration is bit-equal to torch.optim.Muon: the fp32 reference is
    torch's algorithm, not another one."""
    assert run_ranks(_fp32_muon_is_torch_muon, 1) == [True]


def _fsdp_tp(rank, world_size):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_mesh(dp_shard=2, tp=2, device_type="cpu")
    torch.manual_seed(0)
    ref = Mats()
    model = copy.deepcopy(ref)
    # c: colwise (FSDP's dim-0 shard strided within TP's), head: rowwise (Shard(0) x Shard(1))
    parallelize_module(model, mesh["tp"], {"c": ColwiseParallel(), "head": RowwiseParallel()})
    _shard(model, data_parallel_mesh(mesh))
    dp_rank = mesh["dp_shard"].get_local_rank()
    return _train(ref, model, Fp32Muon, dp_rank, 2)


def test_fsdp_x_tp_gathers_over_both_axes():
    errs = run_ranks(_fsdp_tp, 4)
    assert maxerr(e[0] for e in errs) <= TRAINED_FP32_TOL and maxerr(e[1] for e in errs) <= ELEMENTWISE_TOL, errs


class StepCounting(Fp32Muon):
    """Counts its ``step()`` calls, as an optimizer with a step counter (a schedule inside) does."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        return super().step(closure)


def _one_collective_each_way(rank, world_size, buckets):
    mesh = _mesh(world_size)
    torch.manual_seed(0)
    model = _shard(Mats(), mesh)
    opt, _ = _optimizers(model, StepCounting, buckets=buckets)
    calls = []
    real = dist.all_to_all_single

    def spy(out, inp, *a, **kw):
        calls.append(inp.numel())
        return real(out, inp, *a, **kw)

    tokens, target = _batches(1)[0]
    ((model(tokens) - target) ** 2).mean().backward()
    dist.all_to_all_single = spy
    try:
        opt.step()
    finally:
        dist.all_to_all_single = real
    return len(calls), opt.inner.calls


def test_one_gather_and_one_scatter_per_bucket():
    """One all-to-all per bucket and direction; the inner optimizer's ``step()`` once per step
    on each owner, whatever the number of buckets."""
    assert run_ranks(_one_collective_each_way, 2, 1) == [(2, 1), (2, 1)]
    assert run_ranks(_one_collective_each_way, 2, 2) == [(4, 1), (4, 1)]


def test_refusals_are_one_line():
    class Elementwise(torch.optim.SGD):
        pass

    with pytest.raises(TypeError, match="does not declare needs_whole_matrices"):
        WholeMatrixOptimizer(torch.optim.AdamW, [nn.Parameter(torch.ones(2, 2))])
    assert not needs_whole_matrices(Elementwise) and needs_whole_matrices(torch.optim.Muon)
    register_whole_matrix_optimizer(Elementwise)
    assert needs_whole_matrices(Elementwise)
    opt = WholeMatrixOptimizer(torch.optim.Muon, [nn.Parameter(torch.ones(2, 2))])
    with pytest.raises(RuntimeError, match="add_param_group after construction"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2, 2))]})
    with pytest.raises(ValueError, match="2D parameters"):  # the inner optimizer's own check of its settings
        WholeMatrixOptimizer(torch.optim.Muon, [nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(3))])


def _state_of(model, opts):
    """Every optimizer state tensor and parameter, full, by FQN (collective)."""
    from shardwise.checkpoint import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, list(opts))
    out = {f"state/{fqn}/{k}": _full(v).clone() for fqn, st in osd["state"].items() for k, v in st.items()
           if isinstance(v, torch.Tensor)}
    out.update({f"param/{n}": _full(p).clone() for n, p in model.named_parameters()})
    return out


def _save_trained(rank, world_size, path):
    from shardwise.checkpoint import get_model_state_dict, get_optimizer_state_dict, save

    torch.manual_seed(0)
    model = _shard(Mats(), _mesh(world_size))
    opts = _optimizers(model, torch.optim.Muon)
    per = 8 // world_size
    for tokens, target in _batches(2):
        ((model(tokens[rank * per:(rank + 1) * per]) - target[rank * per:(rank + 1) * per]) ** 2).mean().backward()
        for o in opts:
            o.step()
            o.zero_grad()
    save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, list(opts))}, path)
    owners = [opts[0].owner_of(p) for p in split_matrix_params(model)[0]]
    return _state_of(model, opts), owners


def _load_trained(rank, world_size, path):
    from shardwise.checkpoint import (get_model_state_dict, get_optimizer_state_dict, load, set_model_state_dict,
                                      set_optimizer_state_dict)

    torch.manual_seed(1)  # other initial values: everything must come from the checkpoint
    model = _shard(Mats(), _mesh(world_size))
    opts = _optimizers(model, torch.optim.Muon)
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, list(opts))}
    load(sd, path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, list(opts), sd["optim"])
    owners = [opts[0].owner_of(p) for p in split_matrix_params(model)[0]]
    return _state_of(model, opts), owners


def test_checkpoint_reshards_4_to_2_bit_exact(tmp_path):
    """Owner-held state saved on 4 ranks loads on 2 (owners reassigned) bit-exact."""
    path = str(tmp_path / "ck")
    saved, owners4 = run_ranks(_save_trained, 4, path)[0]
    loaded, owners2 = run_ranks(_load_trained, 2, path)[0]
    assert max(owners4) == 3 and max(owners2) == 1, (owners4, owners2)
    assert sorted(saved) == sorted(loaded) and any("momentum_buffer" in k for k in saved), sorted(saved)
    for k in saved:
        assert saved[k].dtype == loaded[k].dtype and torch.equal(saved[k], loaded[k]), k


def test_settings_follow_param_groups_and_schedulers():
    """A learning-rate scheduler changes ``param_groups``; the owner's inner optimizer follows at
    every step (plain parameters: a group of one, no process group needed)."""
    torch.manual_seed(0)
    a = [nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(3, 5))]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    ref = torch.optim.Muon(a, lr=0.05)
    opt = WholeMatrixOptimizer(torch.optim.Muon, b, lr=0.05)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (ref, opt)]
    for step in range(3):
        for p, q in zip(a, b):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            q.grad = p.grad.clone()
        ref.step()
        opt.step()
        for s in scheds:
            s.step()
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 0.05 * 0.5 ** 3
    assert all(torch.equal(p, q) for p, q in zip(a, b)), "the inner optimizer stepped with another lr"
