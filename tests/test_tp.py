"""Tensor parallelism: MLP parity on 2 and 4 gloo ranks, uneven sizes, plans, registry, loss.

Every rank holds the whole batch (tensor parallelism splits weights, not data); the reference
is the same model, unsplit, in the same process. Tolerance: 1e-6 relative in fp32.
"""

from __future__ import annotations

import copy
import warnings

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
import torch
import torch._dynamo  # noqa: F401  DTensor imports it lazily (~2 s a rank); the forkserver preloads it via this module
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from shardwise.composable import (
    DEFAULT_REGISTRY,
    ColwiseParallel,
    ModuleParallel,
    ModuleRule,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    TPRegistry,
    local_shard_range,
    loss_parallel,
    parallelize_module,
    to_local_share,
    vocab_parallel_cross_entropy,
)
from tests._compare import maxerr
from tests._dist import run_ranks

TOL = 1e-6


# ---------------------------------------------------------------- shared helpers


def init_(module: nn.Module, seed: int) -> nn.Module:
    """Fill every parameter from an explicit generator (same values on every rank)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = full(a).detach().float(), full(b).detach().float()
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() if b.numel() else 0.0


def compare_training(ref: nn.Module, model: nn.Module, batches, loss_fn, lr: float = 1e-2) -> dict:
    """Forward output, gradients after the first backward, then AdamW on every batch: losses
    and final parameters. Returns the worst relative error of each kind (by name)."""
    ropt = torch.optim.AdamW(ref.parameters(), lr=lr)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    errs = {"out": 0.0, "loss": 0.0}
    for step, (inp, target) in enumerate(batches):
        ref_out, out = ref(*inp), model(*inp)
        ref_loss, loss = loss_fn(ref_out, target), loss_fn(out, target)
        ref_loss.backward()
        loss.backward()
        if step == 0:
            errs["out"] = rel(out, ref_out)
            ref_params = dict(ref.named_parameters())
            for name, p in model.named_parameters():
                assert p.grad is not None, f"{name} got no gradient"
                if isinstance(p, DTensor):
                    assert p.grad.placements == p.placements, (name, p.grad.placements, p.placements)
                errs[f"grad:{name}"] = rel(p.grad, ref_params[name].grad)
        errs["loss"] = maxerr(errs["loss"], rel(loss, ref_loss))
        for o in (ropt, opt):
            o.step()
            o.zero_grad()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        errs[f"param:{name}"] = rel(p, ref_params[name])
    return errs


def assert_close(results: list[dict], tol: float = TOL) -> None:
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if not v <= tol}
        assert not bad, f"rank {rank}: differs from the single-process model: {bad}"


def placements_of(model: nn.Module) -> dict[str, tuple]:
    return {n: tuple(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}


def tp_mesh(world_size: int):
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))


# ---------------------------------------------------------------- MLP: Colwise + Rowwise


class MLP(nn.Module):
    def __init__(self, dim: int = 6, hidden: int = 7) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _batches(steps, shape, out_shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(shape, generator=g),), torch.randn(out_shape, generator=g)) for _ in range(steps)]


def _mlp_parity(rank, world_size, hidden):
    ref = init_(MLP(6, hidden), seed=0)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh(world_size),
                               {"up": ColwiseParallel(), "down": RowwiseParallel()})
    got = placements_of(model)
    want = {"up.weight": (Shard(0),), "up.bias": (Shard(0),), "down.weight": (Shard(1),),
            "down.bias": (Replicate(),)}
    assert got == want, got
    local = model.up.weight.to_local().shape[0]
    assert local == torch.empty(hidden).chunk(world_size)[rank].numel() if rank < len(
        torch.empty(hidden).chunk(world_size)) else local == 0, local
    return compare_training(ref, model, _batches(3, (2, 5, 6), (2, 5, 6)), _mse)


@pytest.mark.parametrize("world_size,hidden", [(2, 7), (4, 7), (4, 3)],
                         ids=["tp2-hidden7", "tp4-hidden7", "tp4-hidden3-empty-shard"])
def test_mlp_colwise_rowwise_matches_single_process(world_size, hidden):
    assert_close(run_ranks(_mlp_parity, world_size, hidden))


def _mlp_collectives(rank, world_size):
    from torch.distributed.tensor.debug import CommDebugMode

    model = parallelize_module(init_(MLP(6, 7), 0), tp_mesh(world_size),
                               {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with CommDebugMode() as fwd:
        y = model(x)
    with CommDebugMode() as bwd:
        y.sum().backward()
    return ({str(k): v for k, v in fwd.get_comm_counts().items()},
            {str(k): v for k, v in bwd.get_comm_counts().items()})


def test_mlp_costs_one_all_reduce_forward_and_one_backward():
    fwd, bwd = run_ranks(_mlp_collectives, 2)[0]
    assert fwd == {"c10d_functional.all_reduce": 1}, fwd  # Rowwise output
    assert bwd == {"c10d_functional.all_reduce": 1}, bwd  # Colwise input gradient


# ---------------------------------------------------------------- the extension point: a mixture of experts


class TinyMoE(nn.Module):
    """Top-k routed experts: ``y = sum_{e in topk(x)} p_e(x) FFN_e(x)``, ``p = softmax(R x)``."""

    def __init__(self, dim: int = 6, hidden: int = 5, n_experts: int = 3, top_k: int = 2) -> None:
        super().__init__()
        self.router = nn.Parameter(torch.empty(n_experts, dim))
        self.w_in = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w_out = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.top_k = top_k

    def forward(self, x):
        return moe_experts(x, self.router, self.w_in, self.w_out, first=0, top_k=self.top_k)


def moe_experts(x, router, w_in, w_out, *, first: int, top_k: int):
    """The summed, gated outputs of experts ``first .. first + len(w_in)`` (all of them: ``first=0``)."""
    flat = x.reshape(-1, x.shape[-1])
    gate, expert = F.softmax(flat @ router.T, dim=-1).topk(top_k, dim=-1)
    out = torch.zeros_like(flat)
    for j in range(w_in.shape[0]):
        token, slot = (expert == first + j).nonzero(as_tuple=True)
        h = F.silu(flat[token] @ w_in[j].T) @ w_out[j].T
        out = out.index_add(0, token, h * gate[token, slot, None])
    return out.reshape(x.shape)


def moe_local_forward(moe: TinyMoE, x: torch.Tensor) -> torch.Tensor:
    """Expert parallelism: this rank runs its own experts on all tokens; the sum over ranks is
    the layer's output (Partial). ``x`` and the router are replicated: ``x`` arrives as a
    local share and the router is read with ``to_local_share``, so their gradients (this
    rank's part only) are summed over the ranks."""
    first, _ = local_shard_range(moe.w_in, 0)
    return moe_experts(x, to_local_share(moe.router), moe.w_in.to_local(), moe.w_out.to_local(),
                       first=first, top_k=moe.top_k)


MOE_RULE = ModuleRule(
    params={"router": Replicate(), "w_in": Shard(0), "w_out": Shard(0)},
    input_layouts=(Replicate(),), output_layout=Partial(), forward=moe_local_forward,
    summary="y = sum_r sum_{e on rank r} p_e FFN_e(x), experts split over ranks",
)


class MoENet(nn.Module):
    def __init__(self, n_experts: int) -> None:
        super().__init__()
        self.up = nn.Linear(6, 6)
        self.moe = TinyMoE(n_experts=n_experts)

    def forward(self, x):
        return self.moe(torch.tanh(self.up(x)))


def _moe_parity(rank, world_size, n_experts):
    registry = DEFAULT_REGISTRY.with_rule(ModuleParallel, TinyMoE, MOE_RULE)
    ref = init_(MoENet(n_experts), seed=0)
    model = parallelize_module(copy.deepcopy(ref), tp_mesh(world_size),
                               {"up": ColwiseParallel(output_layouts=Replicate()), "moe": ModuleParallel()},
                               registry=registry)
    assert placements_of(model)["moe.w_in"] == (Shard(0),), f"moe.w_in placements {placements_of(model)['moe.w_in']}"
    want = len(range(n_experts)[slice(*local_shard_range(model.moe.w_in, 0))])
    assert model.moe.w_in.to_local().shape[0] == want, f"rank {rank}: {model.moe.w_in.to_local().shape[0]} experts, want {want}"
    return compare_training(ref, model, _batches(3, (2, 5, 6), (2, 5, 6)), _mse)


@pytest.mark.parametrize("world_size,n_experts", [(2, 3), (4, 7)], ids=["tp2-3experts", "tp4-7experts"])
def test_registered_mixture_of_experts_matches_single_process(world_size, n_experts):
    assert_close(run_ranks(_moe_parity, world_size, n_experts))


def test_registry_is_immutable_and_extended_by_copy():
    before = len(DEFAULT_REGISTRY)
    extended = DEFAULT_REGISTRY.with_rule(ModuleParallel, TinyMoE, MOE_RULE)
    assert len(DEFAULT_REGISTRY) == before and len(extended) == before + 1
    assert extended.find(ModuleParallel(), TinyMoE()) is MOE_RULE
    assert DEFAULT_REGISTRY.find(ModuleParallel(), TinyMoE()) is None
    assert extended.find(ColwiseParallel(), nn.Linear(2, 2)) is DEFAULT_REGISTRY.find(ColwiseParallel(), nn.Linear(2, 2))
    with pytest.raises(TypeError):
        DEFAULT_REGISTRY._rules[(ModuleParallel, TinyMoE)] = MOE_RULE
    with pytest.raises(TypeError, match="ModuleRule"):
        TPRegistry().with_rule(ColwiseParallel, nn.Linear, {"weight": Shard(0)})
    with pytest.raises(TypeError, match="Placement"):
        ModuleRule(params={"weight": Shard})
    with pytest.raises(TypeError, match="instance"):
        ColwiseParallel(output_layouts=Shard)


# ---------------------------------------------------------------- plans: patterns and errors


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLP(4, 6) for _ in range(2))
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def _plan_errors(rank, world_size):
    import torch.distributed.tensor.parallel as torch_tp

    mesh = tp_mesh(world_size)
    out = {}

    def error(plan, **kw):
        model = Tower()
        try:
            parallelize_module(model, kw.pop("mesh", mesh), plan, **kw)
        except (ValueError, TypeError) as exc:
            assert not placements_of(model), "a failed plan must leave the model untouched"
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    out["typo"] = error({"layers.*.up": ColwiseParallel(), "layer.*.dwn": RowwiseParallel()}, strict=True)
    out["deep"] = error({"layers.*": ColwiseParallel()})  # matches the two MLPs themselves
    out["depth"] = error({"*.up": ColwiseParallel()}, strict=True)  # '*' stays within one name
    with warnings.catch_warnings(record=True) as caught:  # the default, as torch: warn, skip, apply the rest
        warnings.simplefilter("always")
        lax = parallelize_module(Tower(), mesh, {"layers.*.up": ColwiseParallel(), "layer.*.dwn": RowwiseParallel()})
    out["lax"] = ([f"{w.category.__name__}: {w.message}" for w in caught], sorted(placements_of(lax)))
    out["no_rule"] = error({"norm": ColwiseParallel()})
    out["overlap"] = error({"layers.*.up": ColwiseParallel(), "layers.0.up": ColwiseParallel()})
    class Repartitioned(torch_tp.ColwiseParallel):  # a subclass that changes how torch shards parameters
        @staticmethod
        def _partition_linear_fn(name, module, device_mesh):
            raise AssertionError("never called")

    out["torch_style"] = error({"layers.0.up": Repartitioned()})
    out["not_style"] = error({"layers.0.up": object()})
    out["two_d"] = error({"layers.0.up": ColwiseParallel()},
                         mesh=init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp")))
    model = parallelize_module(Tower(), mesh, {"layers.0.up": ColwiseParallel()})
    try:  # the second entry is refused before the first is applied
        parallelize_module(model, mesh, {"layers.1.up": ColwiseParallel(), "layers.0.up": ColwiseParallel()})
    except ValueError as exc:
        out["twice"] = str(exc)
    assert sorted(placements_of(model)) == ["layers.0.up.bias", "layers.0.up.weight"], "nothing else changed"
    wild = parallelize_module(Tower(), mesh, {"layers.*.up": ColwiseParallel(), "layers.?.down": RowwiseParallel()})
    out["wildcards"] = sorted(placements_of(wild))
    return out


def test_plan_patterns_and_errors():
    out = run_ranks(_plan_errors, 1)[0]
    assert "PlanError" in out["typo"] and "'layer.*.dwn'" in out["typo"] and "'layers.*.down'" in out["typo"], out["typo"]
    assert "no rule for MLP" in out["deep"], out["deep"]
    assert "matches no submodule" in out["depth"] and "'layers.*.up'" in out["depth"], out["depth"]
    warned, applied = out["lax"]
    assert len(warned) == 1 and "PlanWarning" in warned[0] and "'layers.*.down'" in warned[0], warned
    assert applied == [f"layers.{i}.up.{p}" for i in (0, 1) for p in ("bias", "weight")], applied
    assert "TypeError" in out["no_rule"] and "LayerNorm" in out["no_rule"] and "with_rule" in out["no_rule"], out["no_rule"]
    assert "'layers.*.up'" in out["overlap"] and "both shard its parameters" in out["overlap"], out["overlap"]
    assert out["torch_style"].startswith("TypeError: plan['layers.0.up']: Repartitioned overrides _partition_linear_fn "
                                         "of torch's ColwiseParallel"), out["torch_style"]
    assert "use shardwise.composable.ColwiseParallel" in out["torch_style"], out["torch_style"]
    assert "is not a ParallelStyle" in out["not_style"], out["not_style"]
    assert "1-D mesh" in out["two_d"] and "mesh['tp']" in out["two_d"], out["two_d"]
    assert "already DTensors" in out["twice"], out["twice"]
    assert out["wildcards"] == [f"layers.{i}.{m}.{p}" for i in (0, 1) for m in ("down", "up") for p in ("bias", "weight")]


def _overlapping_entries(rank, world_size):
    import torch.distributed.tensor.parallel as torch_tp

    mesh = tp_mesh(world_size)
    torch.manual_seed(0)
    ref = Tower()
    x = torch.randn(2 * world_size, 4)

    def plan(ns):  # the batch arrives sharded on layers.0.up, which the Prepare entry gathers first
        return {"layers.0.up": ns.PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)),
                "layers.*.up": ns.ColwiseParallel(), "layers.*.down": ns.RowwiseParallel(),
                "layers.1.down": ns.PrepareModuleOutput(output_layouts=(Replicate(),),
                                                        desired_output_layouts=(Shard(0),))}
    import shardwise.composable as ours

    outs = {}
    for name, ns in (("ours", ours), ("torch", torch_tp)):
        model = ns.parallelize_module(copy.deepcopy(ref), mesh, plan(ns))
        y = model.layers[1](model.layers[0](x.chunk(world_size)[rank]))
        outs[name] = y.detach()
        y.sum().backward()
        outs[name + "_grad"] = model.layers[0].up.weight.grad.full_tensor()
    expect = ref.layers[1](ref.layers[0](x))
    expect.sum().backward()
    outs["expect"] = expect.detach().chunk(world_size)[rank]
    outs["expect_grad"] = ref.layers[0].up.weight.grad
    try:
        parallelize_module(Tower(), mesh, {"layers.*.up": ColwiseParallel(), "layers.0.up": RowwiseParallel()})
    except ValueError as exc:
        outs["two_sharding"] = str(exc)
    return outs


@pytest.mark.parametrize("world_size", [2])
def test_overlapping_plan_entries_apply_in_order_as_torch(world_size):
    for rank, out in enumerate(run_ranks(_overlapping_entries, world_size)):
        for name in ("ours", "torch"):
            torch.testing.assert_close(out[name], out["expect"], rtol=1e-6, atol=1e-6, msg=f"{name} rank {rank}")
            torch.testing.assert_close(out[name + "_grad"], out["expect_grad"], rtol=1e-6, atol=1e-6)
        assert "both shard its parameters" in out["two_sharding"] and "'layers.0.up'" in out["two_sharding"], out


# ---------------------------------------------------------------- PrepareModuleInput / Output, kwargs, uneven


class AddBias(nn.Module):
    def forward(self, x, *, bias):
        return x * 2 + bias


def _prepare(rank, world_size):
    mesh = tp_mesh(world_size)
    g = torch.Generator().manual_seed(3)
    x, bias = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)  # 5 rows: uneven on 2 and 4
    mine = slice(*[min(r * -(-5 // world_size), 5) for r in (rank, rank + 1)])
    m = AddBias()
    parallelize_module(m, mesh, PrepareModuleInputOutput(
        input_layouts=Shard(0), desired_input_layouts=Replicate(),
        input_kwarg_layouts={"bias": Shard(0)}, desired_input_kwarg_layouts={"bias": Replicate()},
        use_local_input=True, output_layouts=Replicate(), desired_output_layouts=Shard(0),
        uneven_shards=True))  # uneven pieces are opt-in: the ranks exchange their lengths
    out = m(x[mine], bias=bias[mine])  # this rank's rows in, this rank's rows out
    ok_io = torch.equal(out, (x * 2 + bias)[mine])
    n = AddBias()
    parallelize_module(n, mesh, {"": PrepareModuleOutput(output_layouts=Shard(0), desired_output_layouts=Replicate(),
                                                         uneven_shards=True)})
    gathered = n(x[mine], bias=bias[mine])
    return ok_io, torch.equal(gathered, x * 2 + bias)


@pytest.mark.parametrize("world_size", [2, 4])
def test_prepare_module_input_output_with_kwargs_and_uneven_rows(world_size):
    assert all(all(r) for r in run_ranks(_prepare, world_size))


# ---------------------------------------------------------------- loss_parallel / vocab_parallel_cross_entropy


def _loss_cases(rank, world_size):
    mesh = tp_mesh(world_size)
    g = torch.Generator().manual_seed(4)
    C = 11  # classes: uneven on 2 and 4 ranks
    target = torch.randint(0, C, (6,), generator=g)
    target[1] = -100
    cases = {
        "mean": (torch.randn(6, C, generator=g), target, {}),
        "sum": (torch.randn(6, C, generator=g), target, {"reduction": "sum"}),
        "none": (torch.randn(6, C, generator=g), target, {"reduction": "none"}),
        "smooth": (torch.randn(6, C, generator=g), target, {"label_smoothing": 0.1}),
        "weight": (torch.randn(6, C, generator=g), target, {"weight": torch.rand(C, generator=g)}),
        "ignore3": (torch.randn(6, C, generator=g), target.clamp_min(0), {"ignore_index": 3}),
        "3d": (torch.randn(2, C, 3, generator=g), torch.randint(0, C, (2, 3), generator=g), {}),
        "1d": (torch.randn(C, generator=g), torch.tensor(4), {}),
    }
    errs = {}
    reduced = []
    real_all_reduce = torch.distributed.all_reduce

    def counting(t, *a, **k):
        reduced.append(t.numel())
        return real_all_reduce(t, *a, **k)

    for name, (logits, tgt, kw) in cases.items():
        ref_in = logits.clone().requires_grad_()
        ref = F.cross_entropy(ref_in, tgt, **kw)
        ref.sum().backward()
        dt = distribute_tensor(logits.clone(), mesh, [Shard(0 if logits.ndim == 1 else 1)]).requires_grad_()
        torch.distributed.all_reduce = counting
        try:
            if name == "mean":  # the context manager, through nn.CrossEntropyLoss
                with loss_parallel():
                    loss = nn.CrossEntropyLoss()(dt, tgt)
            else:
                loss = vocab_parallel_cross_entropy(dt, tgt, **kw)
        finally:
            torch.distributed.all_reduce = real_all_reduce
        assert isinstance(loss, DTensor) and loss.placements == (Replicate(),), name
        loss.sum().backward()
        assert dt.grad.placements == dt.placements, name
        errs[f"loss:{name}"] = rel(loss, ref)
        errs[f"grad:{name}"] = rel(dt.grad, ref_in.grad)
    n_rows = max(c[0].numel() // C for c in cases.values())
    assert max(reduced) <= 3 * n_rows, f"an all-reduce moved {max(reduced)} values: the classes were gathered"
    return errs


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_cross_entropy_matches_cross_entropy(world_size):
    assert_close(run_ranks(_loss_cases, world_size))


# ---------------------------------------------------------------- index arithmetic


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 40), parts=st.integers(1, 8))
def test_chunk_sizes_and_shard_ranges_follow_torch_chunk(n, parts):
    from shardwise.composable._tp._layouts import chunk_sizes, shard_range

    pieces = torch.arange(n).chunk(parts) if n else ()
    want = [len(p) for p in pieces] + [0] * (parts - len(pieces))
    assert chunk_sizes(n, parts) == want
    starts = [shard_range(n, parts, r) for r in range(parts)]
    assert [b - a for a, b in starts] == want
    assert all(starts[r][0] == (pieces[r][0].item() if want[r] else starts[r][1]) for r in range(parts))
