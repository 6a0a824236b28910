"""The low-precision differential suite's pieces: a toy all-gather extension, the models, the
three recipes (toy bf16 gather, torchao float8, torchao int8 QLoRA) and one training run that
counts the bytes all-gathered.

`Bf16GatherWeight` is this suite's own subclass of FSDP2's all-gather extension (the form with
``module`` and ``mp_policy``): an fp32 weight that is all-gathered in bf16, so its unsharded
weight is the bf16 rounding of the fp32 master. Its one-process reference is `RoundedLinear`
(the same rounding, gradients straight through). Every run builds the same model from a seed,
shards it with one implementation (or not at all: ``"local"``), trains it a few SGD steps on
the same batches (each rank its half of the batch) and returns the losses, the all-gathered
bytes per step (`benchmarks._comm_count.CommCounter`) and the local tensor types.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
import torchao.float8  # noqa: F401  (imported here so that the rank forkserver holds it: a rank starts in 0.2 s)
import torchao.prototype.quantized_training  # noqa: F401

DIM, HIDDEN, LAYERS, BATCH, STEPS, RANK = 32, 64, 3, 8, 4, 4
# what `Bf16GatherWeight.fsdp_post_all_gather` was given and built (the all-gather outputs, the
# unsharded weight), weakly: FSDP frees them at reshard (`held_bytes`), whichever way it does it
GATHERED: list[weakref.ref] = []


def held_bytes() -> int:
    """Bytes still held by the all-gather outputs and unsharded weights of `Bf16GatherWeight`
    parameters: 0 once every unit has resharded (their storage resized to 0, or the tensors
    dropped). A leak (numbers unchanged) shows here."""
    alive = {id(t): t for t in (r() for r in GATHERED) if t is not None}
    return sum(t.untyped_storage().nbytes() for t in alive.values())


class Bf16GatherWeight(torch.Tensor):
    """An fp32 weight whose all-gather moves bf16: FSDP2's extension, 5-argument form."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Bf16GatherWeight:
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=data.dtype,
                                                   device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    _KEEP = {torch.ops.aten.detach.default, torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default,
             torch.ops.aten.slice.Tensor, torch.ops.aten.copy_.default, torch.ops.aten.view.default,
             torch.ops.aten.split.Tensor, torch.ops.aten.clone.default, torch.ops.aten._to_copy.default,
             torch.ops.aten.as_strided.default}

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        a, k = pytree.tree_map_only(Bf16GatherWeight, lambda t: t._data, (args, kwargs or {}))
        out = func(*a, **k)
        if func is torch.ops.aten.copy_.default:
            return args[0]
        if func not in cls._KEEP:
            return out
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Bf16GatherWeight(inner["_data"])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self._data.to(torch.bfloat16),), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,) = outputs
        GATHERED.append(weakref.ref(data if data._base is None else data._base))  # the output buffer, not a view
        if out is not None:
            out.data.copy_(data)  # .data: the in-place refill does not bump what autograd saved
            return None
        full = data.to(param_dtype)
        GATHERED.append(weakref.ref(full))
        return full, (full,)


class PreOnlyWeight(Bf16GatherWeight):
    """A broken extension: ``fsdp_pre_all_gather`` without ``fsdp_post_all_gather``."""

    def __getattribute__(self, name: str) -> Any:
        if name == "fsdp_post_all_gather":
            raise AttributeError(name)
        return super().__getattribute__(name)


class _RoundBf16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return w.to(torch.bfloat16).to(w.dtype)

    @staticmethod
    def backward(ctx, g):
        return g


class RoundedLinear(nn.Linear):
    """The one-process reference of a `Bf16GatherWeight` linear."""

    def forward(self, x):
        return F.linear(x, _RoundBf16.apply(self.weight), self.bias)


class LoRALinear(nn.Module):
    """A frozen base linear and a trainable low-rank update ``B @ A`` (B starts at zero)."""

    def __init__(self, base: nn.Linear, rank: int = RANK, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # nonzero so step one already trains A
        self.scale = alpha / rank

    def forward(self, x):
        return self.base(x) + self.scale * self.lora_b(self.lora_a(x))


class Net(nn.Module):
    def __init__(self, linear: type[nn.Linear] = nn.Linear) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(linear(DIM, HIDDEN), nn.GELU(), linear(HIDDEN, DIM)) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def build(recipe: str, local: bool) -> nn.Module:
    """The model of ``recipe`` (seeded): ``toy`` (Bf16GatherWeight weights; ``local``: the
    RoundedLinear reference), ``float8`` (torchao float8 training, float8 all-gather), ``qlora``
    (torchao int8 weight-only quantized base, frozen, LoRA adapters in fp32)."""
    torch.manual_seed(0)
    if recipe == "toy":
        model = Net(RoundedLinear if local else nn.Linear)
        if not local:
            for layer in model.layers:
                for m in (layer[0], layer[2]):
                    m.weight = nn.Parameter(Bf16GatherWeight(m.weight.detach()))
        return model
    if recipe == "float8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        model = Net()
        cfg = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        return convert_to_float8_training(model, config=cfg, module_filter_fn=lambda m, fqn: fqn.startswith("layers"))
    if recipe == "qlora":
        from torchao import quantize_
        from torchao.prototype.quantized_training import int8_weight_only_quantized_training

        model = Net()
        for layer in model.layers:
            for i in (0, 2):
                quantize_(layer[i], int8_weight_only_quantized_training())
                layer[i].weight.requires_grad_(False)
                layer[i].bias.requires_grad_(False)
                layer[i] = LoRALinear(layer[i])
        for p in model.head.parameters():
            p.requires_grad_(False)
        return model
    raise ValueError(f"unknown recipe {recipe!r}")


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)


def local_types(model: nn.Module) -> dict[str, str]:
    """Parameter name -> the type of its (local) tensor, as the optimizer sees it."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        t = p._local_tensor if isinstance(p, DTensor) else p  # noqa: SLF001 (a test reads what FSDP2 users read)
        out[name] = type(t).__name__
    return out


def train(impl: str, recipe: str, rank: int, world: int, precompute: bool = False, hsdp: bool = False,
          bf16: bool = False) -> dict[str, Any]:
    """``STEPS`` SGD steps of ``recipe`` under ``impl`` (``torch``, ``shardwise`` or ``local``);
    losses of the whole batch (mean over ranks), all-gathered bytes and collectives per step.
    ``precompute``: torchao's ``precompute_float8_dynamic_scale_for_fsdp`` after each step;
    ``hsdp``: a ``(2, world // 2)`` (replicate, shard) mesh; ``bf16``: ``MixedPrecisionPolicy(
    param_dtype=bf16, reduce_dtype=fp32)`` (``local``: the model run under bf16 autocast is not the
    same computation, so the caller compares it at a bf16 tolerance)."""
    import torch.distributed as dist

    from benchmarks._comm_count import CommCounter

    model = build(recipe, local=impl == "local")
    if impl != "local":
        if impl == "torch":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        else:
            from shardwise.composable import MixedPrecisionPolicy, fully_shard  # type: ignore[no-redef]
        from torch.distributed.device_mesh import init_device_mesh

        if hsdp:
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world,))
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
    types = local_types(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses, gathered, kinds, held = [], [], [], []
    share = BATCH // world
    for step in range(STEPS):
        x, y = data(step)
        if impl != "local":
            x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        counter = CommCounter()
        with counter:
            out = model(x)
            loss = F.mse_loss(out.float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if precompute:
                from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

                precompute_float8_dynamic_scale_for_fsdp(model)
        full = loss.detach().clone()
        if impl != "local":
            dist.all_reduce(full)
            full /= world
        losses.append(full.item())
        gathered.append(sum(c.size_bytes for c in counter.calls if c.kind == "all_gather"))
        kinds.append(counter.by_kind())
        held.append(held_bytes())  # every unit resharded after the step
    return {"losses": losses, "all_gather_bytes": gathered, "kinds": kinds, "types": types, "held_bytes": held,
            "scales": precomputed_scales(model) if precompute and impl != "local" else []}


def precomputed_scales(model: nn.Module) -> list[tuple[float, float]]:
    """``(scale the rank holds, scale of the whole weight)`` of every float8 weight after
    ``precompute_float8_dynamic_scale_for_fsdp``: equal when its all-reduce of amaxes ran."""
    from torch.distributed.tensor import DTensor

    out = []
    for m in model.modules():
        w = getattr(m, "weight", None)
        local = w._local_tensor if isinstance(w, DTensor) else None  # noqa: SLF001 (torchao writes it there)
        if local is not None and getattr(local, "_precomputed_scale", None) is not None:
            amax = w.full_tensor().detach().abs().max().clamp(min=1e-12).double()
            out.append((float(local._precomputed_scale), float(torch.finfo(torch.float8_e4m3fn).max / amax)))
    return out


def train_tp(impl: str, rank: int, world: int, tp_impl: str = "torch") -> dict[str, Any]:
    """float8 with tensor parallelism: torchao's Float8ColwiseParallel / Float8RowwiseParallel on
    the layers' two linears over a 2-rank TP axis, applied by ``tp_impl``'s ``parallelize_module``
    (torch's or shardwise's; ``rebound``: torch's names, rebound to shardwise's before torchao's
    styles were imported, so they subclass shardwise's), then ``impl``'s ``fully_shard`` over the
    2-rank DP axis (4 ranks);
    ``local``: the float8 model on one process. Losses of the whole batch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    model = build("float8", local=impl == "local")
    casts = [0]
    if impl != "local":
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        # torchao's float8 styles subclass torch's ColwiseParallel / RowwiseParallel: shardwise's
        # parallelize_module runs them as its own styles with torchao's hooks
        if tp_impl in ("torch", "rebound"):  # rebound: torch's names are shardwise's (tests/compat/_rebind.py)
            from torch.distributed.tensor.parallel import parallelize_module
        else:
            from shardwise.composable import parallelize_module  # type: ignore[no-redef]

        if impl == "torch":
            from torch.distributed.fsdp import fully_shard
        else:
            from shardwise.composable import fully_shard  # type: ignore[no-redef]
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], {"0": Float8ColwiseParallel(), "2": Float8RowwiseParallel()})
        import torchao.float8.float8_tensor_parallel as f8tp

        cast = f8tp.hp_tensor_to_float8_dynamic  # counted: torchao's own input hooks must run

        def counted(*a, **k):
            casts[0] += 1
            return cast(*a, **k)

        f8tp.hp_tensor_to_float8_dynamic = counted
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    types = local_types(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    dp_rank, share = (rank // 2, BATCH // 2) if impl != "local" else (0, BATCH)
    for step in range(STEPS):
        x, y = data(step)
        x, y = x[dp_rank * share : (dp_rank + 1) * share], y[dp_rank * share : (dp_rank + 1) * share]
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        full = loss.detach().clone()
        if impl != "local":
            dist.all_reduce(full)
            full /= world
        losses.append(full.item())
    return {"losses": losses, "types": types, "input_casts": casts[0]}
