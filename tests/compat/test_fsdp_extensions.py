"""Differential: FSDP2's all-gather extension (a parameter whose local shard is a tensor subclass
with ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``), torch's FSDP2 vs shardwise vs one process,
on 2 gloo ranks (4 for HSDP and TP x FSDP). Three clients: this suite's toy `Bf16GatherWeight`
(5-argument hook), torchao's float8 training weight (1-argument hook, float8 all-gather) and
torchao's int8 weight-only quantized training weight under LoRA adapters (QLoRA; two pieces of two
dtypes). Each run checks the losses against one process, the sharded parameters' local tensor
types, and the bytes all-gathered per step (``benchmarks._comm_count.CommCounter``) against the
theory: every unit moves each low-precision weight in its gathered dtype and every other parameter
in its own, once per all-gather (forward and backward for the layers, once for the root)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests._compare import rel_errs
from tests._dist import run_ranks
from tests.compat import _lowp as L  # imports torchao
from tests.compat._adapter import IMPLS

WORLD = 2
# fp32 and exact gathers (toy: bf16 rounding happens the same way in the reference; QLoRA: int8
# moves losslessly): the sharded run differs from one process by the order of the gradient sums
FP32 = 1e-6
# float8: the activations and output gradients are cast with a tensorwise scale from each rank's
# own half batch (one process: from the whole batch), so the losses differ by float8 rounding;
# measured at most 2.2e-3 relative over the 4 steps (torch and shardwise alike), stated 5e-3
FLOAT8 = 5e-3
# bf16 compute (MixedPrecisionPolicy) against the fp32 one-process run: bf16 rounding of activations
# and weights, measured 4.8e-4 (both implementations; printed with -s), stated 2e-2
BF16 = 2e-2


def _body(rank, world, impl, recipe, kw):
    return L.train(impl, recipe, rank, world, **kw)


def _run(impl: str, recipe: str, world: int = WORLD, **kw) -> dict:
    if impl == "local":
        return run_ranks(_body, 1, "local", recipe, kw, timeout=180)[0]
    return run_ranks(_body, world, impl, recipe, kw, timeout=180)[0]


def _rel(a: list[float], b: list[float]) -> float:
    worst = rel_errs(a, b)  # inf for a NaN anywhere (Python's max skipped one after the first)
    print(f" [max relative loss difference {worst:.1e}]", end="")
    return worst


def _gathered_itemsize(recipe: str, name: str, p: torch.Tensor, bf16: bool) -> float:
    """Bytes per element all-gathered for parameter ``name`` of the ``recipe`` model."""
    low = name.endswith("weight") and "lora" not in name and name.split(".")[-2] in ("0", "2", "base")
    if low and recipe == "toy":
        return 2  # bf16
    if low and recipe == "float8":
        return 1  # float8_e4m3fn
    if low and recipe == "qlora":
        return 1 + 4 / p.shape[1]  # int8 data and one fp32 scale a row
    return 2 if bf16 else p.element_size()


def _theory(recipe: str, bf16: bool = False) -> int:
    """All-gathered bytes of one step: each layer unit twice (forward, and backward after
    resharding), the root (the head) once. Every segment is a multiple of 4 bytes here, so the
    unit's buffer has no alignment gaps."""
    model = L.build(recipe, local=True)
    per_layer = [sum(p.numel() * _gathered_itemsize(recipe, n, p, bf16) for n, p in layer.named_parameters())
                 for layer in model.layers]
    head = sum(p.numel() * (2 if bf16 else 4) for p in model.head.parameters())
    return int(2 * sum(per_layer) + head)


@pytest.fixture(scope="module")
def local_runs() -> dict[str, dict]:
    return {r: _run("local", r) for r in ("toy", "float8", "qlora")}


@pytest.mark.parametrize("name", IMPLS)
def test_toy_subclass_gathers_bf16(name, local_runs):
    """A toy subclass (FSDP2's 5-argument hook): bf16 all-gathered, losses as one process whose
    linears round their weights to bf16, the local tensor kept a subclass."""
    got = _run(name, "toy")
    assert _rel(got["losses"], local_runs["toy"]["losses"]) <= FP32, (got["losses"], local_runs["toy"]["losses"])
    assert got["types"]["layers.0.0.weight"] == "Bf16GatherWeight", got["types"]
    assert got["types"]["layers.0.0.bias"] == "Tensor", got["types"]  # a mixed unit
    assert got["all_gather_bytes"] == [_theory("toy")] * L.STEPS, (got["all_gather_bytes"], _theory("toy"))
    assert got["held_bytes"] == [0] * L.STEPS, f"all-gather outputs kept after reshard: {got['held_bytes']} bytes"


@pytest.mark.parametrize("name", IMPLS)
def test_toy_subclass_hsdp_and_mixed_precision(name, local_runs):
    """HSDP (the hook's mesh is the shard axis) and bf16 compute with fp32 reduction."""
    got = _run(name, "toy", world=4, hsdp=True)
    assert _rel(got["losses"], local_runs["toy"]["losses"]) <= FP32, (got["losses"], local_runs["toy"]["losses"])
    assert got["all_gather_bytes"] == [_theory("toy")] * L.STEPS
    mp = _run(name, "toy", bf16=True)
    assert _rel(mp["losses"], local_runs["toy"]["losses"]) <= BF16, (mp["losses"], local_runs["toy"]["losses"])
    assert mp["all_gather_bytes"] == [_theory("toy", bf16=True)] * L.STEPS
    assert got["held_bytes"] == mp["held_bytes"] == [0] * L.STEPS, \
        f"all-gather outputs kept after reshard: {got['held_bytes']}, {mp['held_bytes']} bytes"


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("precompute", [False, True])
def test_float8_training(name, precompute, local_runs):
    """torchao float8 (tensorwise) with the float8 all-gather: 1 byte a weight element; with
    ``precompute_float8_dynamic_scale_for_fsdp`` the scales of all weights take one all-reduce a
    step instead of one per weight per all-gather."""
    got = _run(name, "float8", precompute=precompute)
    assert _rel(got["losses"], local_runs["float8"]["losses"]) <= FLOAT8, (got["losses"], local_runs["float8"]["losses"])
    assert got["types"]["layers.0.0.weight"] == "WeightWithDynamicFloat8CastTensor", got["types"]
    assert got["all_gather_bytes"] == [_theory("float8")] * L.STEPS, (got["all_gather_bytes"], _theory("float8"))
    reduces = [k.get("all_reduce", (0, 0.0))[0] for k in got["kinds"]]
    # without precompute: each of the 6 float8 weights reduces its amax at each of its 2 all-gathers;
    # with it, none in forward or backward after the first step (the precompute's own all-reduce
    # runs inside DTensor's dispatch, which the counter does not see: its effect is checked instead,
    # every rank holds the scale of the whole weight)
    assert reduces[1:] == ([0] if precompute else [2 * 2 * L.LAYERS]) * (L.STEPS - 1), reduces
    if precompute:
        assert len(got["scales"]) == 2 * L.LAYERS, got["scales"]
        assert all(abs(a - b) <= 1e-6 * b for a, b in got["scales"]), got["scales"]


def test_float8_losses_equal_torch():
    """shardwise's float8 run is torch's, to the bit (the same casts, the same collectives)."""
    t, s = _run("torch", "float8", precompute=True), _run("shardwise", "float8", precompute=True)
    assert t["losses"] == s["losses"] and t["all_gather_bytes"] == s["all_gather_bytes"], (t, s)


@pytest.mark.parametrize("name", IMPLS)
def test_qlora_int8_base(name, local_runs):
    """QLoRA: torchao's int8 weight-only quantized weights (frozen) gathered in int8 with their
    fp32 row scales, fp32 LoRA adapters trained on top: losses as one process."""
    got = _run(name, "qlora")
    assert _rel(got["losses"], local_runs["qlora"]["losses"]) <= FP32, (got["losses"], local_runs["qlora"]["losses"])
    assert got["types"]["layers.0.0.base.weight"] == "Int8QuantizedTrainingLinearWeight", got["types"]
    assert got["all_gather_bytes"] == [_theory("qlora")] * L.STEPS, (got["all_gather_bytes"], _theory("qlora"))
    assert got["losses"][-1] < got["losses"][0] - 1e-3, got["losses"]  # the adapters train


def _tp_body(rank, world, impl, tp_impl="torch"):
    return L.train_tp(impl, rank, world, tp_impl)


def _rebound_tp_body(rank, world):
    import sys

    import shardwise.composable as sw
    from tests.compat._rebind import rebind_to_shardwise

    rebind_to_shardwise(clients=())
    sys.modules.pop("torchao.float8.float8_tensor_parallel", None)  # imported again: subclasses shardwise's
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

    assert issubclass(Float8ColwiseParallel, sw.ColwiseParallel), Float8ColwiseParallel.__mro__
    return L.train_tp("shardwise", rank, world, "rebound")


def test_float8_tp_fsdp():
    """TP x FSDP with float8 weights (torchao's Float8ColwiseParallel / Float8RowwiseParallel
    over 2 TP ranks, fully_shard over 2 DP ranks): torch and shardwise give the same losses,
    near one process's; so does shardwise's parallelize_module given torchao's style objects,
    subclassing torch's classes or (torch's names rebound) shardwise's ([Note: torch's style
    objects in a plan])."""
    local = run_ranks(_tp_body, 1, "local", timeout=180)[0]
    t, s = (run_ranks(_tp_body, 4, n, timeout=240)[0] for n in IMPLS)
    both = run_ranks(_tp_body, 4, "shardwise", "shardwise", timeout=240)[0]
    rebound = run_ranks(_rebound_tp_body, 4, timeout=240)[0]
    assert s["losses"] == t["losses"], (s["losses"], t["losses"])
    assert both["losses"] == rebound["losses"] == t["losses"], (both["losses"], rebound["losses"], t["losses"])
    assert _rel(s["losses"], local["losses"]) <= FLOAT8, (s["losses"], local["losses"])
    # torchao's input hook casts each TP linear's input once a forward: 2 linears a layer, each step
    casts = [both["input_casts"], rebound["input_casts"], t["input_casts"]]
    assert casts == [2 * L.LAYERS * L.STEPS] * 3, casts
    for got in (s, both):
        assert got["types"]["layers.0.0.weight"] == "WeightWithDynamicFloat8CastTensor", got["types"]


def _prepare_float8(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

    from shardwise.composable import parallelize_module

    style = PrepareFloat8ModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    try:
        parallelize_module(L.build("float8", local=False).layers[0], init_device_mesh("cpu", (world,)), {"": style})
    except TypeError as e:
        return str(e)
    return "no error"


def test_prepare_float8_module_input_refused_in_one_line():
    """torchao's PrepareFloat8ModuleInput overrides torch's per-argument conversion, which cannot
    run without torch's implementation: refused on every rank, naming the style to use instead."""
    for msg in run_ranks(_prepare_float8, 2, timeout=120):
        assert msg == ("plan['']: PrepareFloat8ModuleInput overrides _prepare_input_arg of torch's "
                       "PrepareModuleInput, which shardwise cannot run without torch's implementation; use "
                       "shardwise.composable.PrepareModuleInput (same arguments) or a shardwise ParallelStyle "
                       "subclass"), msg


# -- what is refused, in one line on every rank --------------------------------------------------

def _refusal(rank, world, case):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from shardwise.composable import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    rows = 3 if case == "uneven" else 4
    lin = nn.Linear(4, rows)
    cls = L.PreOnlyWeight if case == "one_hook" else L.Bf16GatherWeight
    lin.weight = nn.Parameter(cls(lin.weight.detach()))
    kw = {}
    if case == "dim1":
        kw["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 else None
    if case == "reshard_int":
        kw["reshard_after_forward"] = 2
    try:
        fully_shard(lin, mesh=mesh, **kw)
        lin(torch.randn(2, 4)).sum().backward()
    except (ValueError, NotImplementedError) as e:
        return str(e)
    return None


@pytest.mark.parametrize("case,words", [
    ("dim1", "sharded on dim 1"),
    ("uneven", "uneven over 2 ranks"),
    ("one_hook", "needs both fsdp_pre_all_gather and fsdp_post_all_gather"),
])
def test_refused_in_one_line(case, words):
    msgs = run_ranks(_refusal, WORLD, case, timeout=60)
    assert all(m is not None and words in m and "\n" not in m for m in msgs), msgs


def test_reshard_after_forward_int_refused():
    """FSDP2 raises NotImplementedError for a subclass resharded onto a smaller group; shardwise
    refuses it in one line at the first forward's reshard (4 ranks, k = 2)."""
    msgs = run_ranks(_refusal, 4, "reshard_int", timeout=60)
    assert all(m is not None and "reshard_after_forward=<int>" in m for m in msgs), msgs


def test_refusal_bodies_pass_a_valid_subclass():
    """The same body with an evenly sharded dim-0 subclass weight trains and reports nothing."""
    assert run_ranks(_refusal, WORLD, "valid", timeout=60) == [None, None]
