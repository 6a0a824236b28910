"""Differential: Lightning 2.6's Fabric with `ModelParallelStrategy`, once on torch's FSDP2 / TP /
DCP and once with those names rebound to shardwise (`tests/compat/_rebind.py`, in every rank).

The script is Lightning's documented one: a ``parallelize_fn`` that calls
``torch.distributed.fsdp.fully_shard`` (and ``torch.distributed.tensor.parallel``'s
``parallelize_module`` for TP) on the strategy's device mesh, the model built under
``fabric.init_module(empty_init=True)`` (meta device; Fabric materializes it with
``to_empty`` + ``reset_parameters``), ``fabric.setup`` / ``setup_optimizers``, ``fabric.backward`` over two microbatches a step, the
first inside ``fabric.no_backward_sync(model)`` (Lightning calls
``set_requires_gradient_sync(False, recurse=False)`` on each `FSDPModule`; after that backward
no sharded parameter has a gradient yet),
``fabric.clip_gradients`` (FSDP only: with TP the parameters live on two meshes, the 1-D
data-parallel one and the 2-D one, and torch's ``clip_grad_norm_`` raises "All operands in
aten.stack.default must have the same mesh"), and ``fabric.save`` / ``fabric.load`` (its sharded checkpoint: DCP
for the model and the optimizer, ``meta.pt`` for the rest). The model is the suite's `TinyLM`
(`tests/compat/_adapter.py`); with TP its blocks are split Megatron-style and its head's
logits stay sharded by class, the loss computed and backpropagated inside ``loss_parallel()``. Scenario: 4 steps, saved after step 2 and training on; then, in
fresh processes, a new Fabric loads the step-2 checkpoint and trains steps 3-4: they must equal
the uninterrupted run's exactly, and shardwise's losses torch's within 1e-6 relative (fp32).
Each rank asserts which implementation sharded the model (`tests/compat/_rebind.py`
``assert_ran``). torch's side is golden data (`tests/compat/_golden.py`), checked by the same
assertions as shardwise's run.
"""

from __future__ import annotations

import contextlib

from tests._compare import rel_errs
from tests._dist import run_ranks
from tests.compat._adapter import BATCH, TinyLM, loss_of
from tests.compat._golden import golden, record_each, recorded_run_test
from tests.compat._rebind import assert_ran, use

STEPS, SAVE_AT = 4, 2


def _parallelize(model, device_mesh):
    """The user's ``parallelize_fn``: torch's public names (rebound for shardwise by `use`)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp_mesh, dp_mesh = device_mesh["tensor_parallel"], device_mesh["data_parallel"]
    if tp_mesh.size() > 1:  # Megatron blocks; the head's logits stay sharded by class for loss_parallel
        col, row = ColwiseParallel, RowwiseParallel
        for block in model.blocks:
            parallelize_module(block, tp_mesh, {"attn.q": col(), "attn.k": col(), "attn.v": col(), "attn.o": row(),
                                                "mlp.w1": col(), "mlp.w2": row()})
        parallelize_module(model, tp_mesh, {"head": col(output_layouts=Shard(-1), use_local_output=False)})
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def _data(dp_rank: int, dp_size: int):
    import torch

    from tests.compat._adapter import SEQ, VOCAB

    g = torch.Generator().manual_seed(1)
    full = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]
    per = BATCH // dp_size
    return [t[dp_rank * per:(dp_rank + 1) * per] for t in full]


def _fabric_run(rank, world_size, impl, path, tp, resume):
    use(impl)
    import torch
    import torch.distributed as dist
    from lightning.fabric import Fabric
    from torch.distributed.tensor.parallel import loss_parallel
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(_parallelize, data_parallel_size=world_size // tp, tensor_parallel_size=tp)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="32-true")
    fabric.launch()
    fabric.seed_everything(0)
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = TinyLM()
    assert all(p.is_meta for p in model.parameters()), "init_module(empty_init=True) did not build on meta"
    model = fabric.setup(model)
    ran = assert_ran(impl, model, tp=tp > 1)  # the units (and TP hooks) are impl's, in this rank
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    mesh = fabric.strategy.device_mesh
    dp_rank, dp_size = mesh["data_parallel"].get_local_rank(), mesh["data_parallel"].size()
    data = _data(dp_rank, dp_size)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume:
        fabric.load(path, state)
    out = {"ran": ran, "start": state["step"], "losses": [], "grads_inside_no_sync": None}
    while state["step"] < STEPS:
        tokens = data[state["step"]]
        half = tokens.shape[0] // 2
        loss = 0.0
        for micro in range(2):  # two microbatches: the first without gradient sync
            with fabric.no_backward_sync(model, enabled=(micro == 0)), \
                    loss_parallel() if tp > 1 else contextlib.nullcontext():
                part = loss_of(model, tokens[micro * half:(micro + 1) * half]) / 2
                fabric.backward(part)
            loss = loss + part.detach()
            if micro == 0 and out["grads_inside_no_sync"] is None:  # FSDP2 keeps them unsharded, unset
                out["grads_inside_no_sync"] = [n for n, p in model.named_parameters() if p.grad is not None]
        if tp == 1:  # with TP, torch's clip_grad_norm_ cannot stack the norms of a 1-D and a 2-D mesh
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        mean = loss
        mean = mean.full_tensor() if hasattr(mean, "full_tensor") else mean.clone()  # loss_parallel: a DTensor
        dist.all_reduce(mean)
        out["losses"].append((mean / dist.get_world_size()).item())
        if state["step"] == SAVE_AT and not resume:
            fabric.save(path, state)
    return out


def flow(impl: str, path: str, world: int, tp: int) -> tuple[dict, dict]:
    first = run_ranks(_fabric_run, world, impl, path, tp, False, timeout=240)[0]
    second = run_ranks(_fabric_run, world, impl, path, tp, True, timeout=240)[0]
    return first, second


def check(impl: str, got, want, world: int, tp: int) -> None:
    """``got``: (uninterrupted, resumed) rank-0 results of ``impl``; ``want``: torch's."""
    first, second = got
    t_first = want[0]
    ran = {"fsdp": [impl], "tp": [impl] if tp > 1 else []}
    assert first["ran"] == second["ran"] == ran, f"{impl}: the ranks saw {first['ran']} / {second['ran']}, want {ran}"
    assert len(first["losses"]) == STEPS and rel_errs(first["losses"], t_first["losses"]) <= 1e-6, \
        f"{impl}: losses {first['losses']} vs torch's {t_first['losses']}"
    assert first["grads_inside_no_sync"] == [], \
        f"{impl}: gradients set after a backward inside no_backward_sync: {first['grads_inside_no_sync']}"
    assert second["start"] == SAVE_AT and second["losses"] == first["losses"][SAVE_AT:], \
        f"{impl}: resumed at {second['start']} with {second['losses']} vs uninterrupted {first['losses'][SAVE_AT:]}"


SCENARIOS = {"lightning_fabric_fsdp": (2, 1), "lightning_fabric_tp": (2, 2)}  # golden name: (world, tp)


def _torch_side(tmp, world: int, tp: int):
    return flow("torch", str(tmp / "torch.ckpt"), world, tp)


record_each(SCENARIOS, _torch_side, clients=("lightning",))


test_torchs_recorded_run_passes_the_same_checks = recorded_run_test(SCENARIOS, check)


def test_fabric_fsdp_meta_init_save_resume(tmp_path):
    check("shardwise", flow("shardwise", str(tmp_path / "shardwise.ckpt"), 2, 1), golden("lightning_fabric_fsdp"), 2, 1)


def test_fabric_tp_meta_init_save_resume(tmp_path):
    check("shardwise", flow("shardwise", str(tmp_path / "shardwise.ckpt"), 2, 2), golden("lightning_fabric_tp"), 2, 2)
