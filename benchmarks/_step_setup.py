"""The layouts of `benchmarks/step.py`: how each implementation builds and shards the model.

``build(cfg, layout, impl, mesh)`` gives the Llama of ``examples/model.py`` from seed 0, sharded
by shardwise (``impl="shardwise"``) or by the torch baseline (``"baseline"``: FSDP2 with the same
mesh and ``reshard_after_forward``, torch's tensor parallelism for FSDPxTP, DDP for the DDP
layout, FSDP2 on the same ``(W, 1)`` mesh for NO_SHARD); ``unit_bytes`` the bytes of each unit as the collectives carry them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from examples.model import Llama, LlamaConfig


@dataclass(frozen=True)
class Layout:
    name: str
    replicate: int = 1  # dp_replicate
    tp: int = 1
    reshard_after_forward: bool = True
    baseline: str = "torch FSDP2"
    no_shard: bool = False  # the (W, 1) mesh of NO_SHARD: every rank a replica, shard axis of 1
    float8: bool = False  # torchao float8 training with the float8 all-gather (module docstring)
    compile: bool = False  # shardwise: torch.compile(model, fullgraph=True); baseline: FSDP2 + per-block compile

    def applies(self, world: int) -> bool:
        if self.name == "HSDP" or self.tp > 1:
            return world >= 4 and world % (self.replicate * self.tp) == 0
        return True


LAYOUTS = {
    "FSDP": Layout("FSDP"),
    "HSDP": Layout("HSDP", replicate=2),
    "SHARD_GRAD_OP": Layout("SHARD_GRAD_OP", reshard_after_forward=False),
    "FSDPxTP": Layout("FSDPxTP", tp=2),
    "DDP": Layout("DDP", reshard_after_forward=False, baseline="torch DDP", no_shard=True),
    "NO_SHARD": Layout("NO_SHARD", reshard_after_forward=False, no_shard=True),  # not run by default
    "FSDP_FLOAT8": Layout("FSDP_FLOAT8", float8=True),  # not run by default (torchao)
    "FSDP_COMPILE": Layout("FSDP_COMPILE", baseline="torch FSDP2 + per-block compile", compile=True),  # opt-in
}
COMPILE_BACKEND = "inductor"  # FSDP_COMPILE's torch.compile backend (step.py --compile-backend)
DEFAULT_LAYOUTS = ("FSDP", "HSDP", "SHARD_GRAD_OP", "FSDPxTP", "DDP")


def tp_plan(s) -> dict:
    """Megatron-style plan of one block; ``s`` holds the style classes (shardwise's or torch's).

    Attention and feed-forward take their input as one replicated DTensor, so the gradients of
    q/k/v (and w1/w3) with respect to it add up before a single all-reduce in backward: 4
    all-reduces per block in all, Megatron's count. Without the two ``PrepareModuleInput`` each
    column-wise layer all-reduces its own input gradient: 7 per block."""
    from torch.distributed.tensor import Replicate

    x, rest = (Replicate(),), (None, None)  # attention(x, cos, sin), feed_forward(x)
    return {"attention": s.PrepareModuleInput(input_layouts=x + rest, desired_input_layouts=x + rest,
                                              use_local_output=False),
            "attention.wq": s.ColwiseParallel(), "attention.wk": s.ColwiseParallel(),
            "attention.wv": s.ColwiseParallel(), "attention.wo": s.RowwiseParallel(),
            "feed_forward": s.PrepareModuleInput(input_layouts=x, desired_input_layouts=x, use_local_output=False),
            "feed_forward.w1": s.ColwiseParallel(), "feed_forward.w3": s.ColwiseParallel(),
            "feed_forward.w2": s.RowwiseParallel()}


def apply_tp(model: Llama, tp_mesh, styles, parallelize) -> None:
    for block in model.layers:
        parallelize(block, tp_mesh, tp_plan(styles))
        block.attention.n_heads //= tp_mesh.size()  # attention reshapes by its per-rank heads
        block.attention.n_kv_heads //= tp_mesh.size()


def is_float8_linear(module: torch.nn.Module, fqn: str) -> bool:
    """The linears the FSDP_FLOAT8 layout converts: those of the blocks (torchtitan leaves the
    output head in high precision), with both dims multiples of 16 as float8 matmuls need."""
    return (fqn.startswith("layers.") and isinstance(module, torch.nn.Linear)
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def to_float8(model: Llama) -> Llama:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    cfg = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(model, config=cfg, module_filter_fn=is_float8_linear)


def after_step(layout: Layout, model) -> None:
    """What a layout runs after each optimizer step: FSDP_FLOAT8's one all-reduce of all scales."""
    if layout.float8:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def build(cfg: LlamaConfig, layout: Layout, impl: str, mesh):
    """The model sharded by ``impl`` ("shardwise" or "baseline") for ``layout``."""
    from shardwise.composable import strategy_mesh
    from shardwise.mesh import data_parallel_mesh

    model = Llama(cfg, generator=torch.Generator().manual_seed(0))
    if layout.float8:
        model = to_float8(model)
    if layout.name == "DDP" and impl == "baseline":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, forward_sync_buffers=False)  # shardwise syncs no buffers
    if layout.name == "DDP":  # the NO_SHARD strategy: replicate, plain parameters (docs/strategies.md)
        from shardwise.composable import ShardingPolicy, apply_fully_shard

        return apply_fully_shard(model, mesh, ShardingPolicy(strategy="NO_SHARD"))
    if impl == "shardwise":
        import shardwise.composable as styles
        from shardwise.composable import fully_shard, parallelize_module
    else:
        import torch.distributed.tensor.parallel as styles
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module
    if layout.tp > 1:
        apply_tp(model, mesh["tp"], styles, parallelize_module)
    dp_mesh = strategy_mesh("NO_SHARD", mesh) if layout.no_shard else data_parallel_mesh(mesh)
    raf = layout.reshard_after_forward
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=raf)
        if layout.compile and impl == "baseline":  # the FSDP2 recipe: compile each block, hooks eager
            block.compile(backend=COMPILE_BACKEND)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=None if raf else False)
    if layout.compile and impl == "shardwise":  # the whole model, one graph ([Note: the traced unit])
        return torch.compile(model, fullgraph=True, backend=COMPILE_BACKEND)
    return model


def unit_bytes(cfg: LlamaConfig, layout: Layout, mesh, shard: int, gathered: bool = False) -> tuple[list[int], int]:
    """(bytes of each block unit, bytes of the root unit) as communicated: TP-local shapes,
    each parameter padded to a multiple of ``shard`` rows. ``gathered``: as all-gathered (a
    float8 weight of FSDP_FLOAT8: 1 byte an element), else as reduced (the gradients' dtype)."""
    import shardwise.composable as sw

    model = Llama(cfg, generator=torch.Generator().manual_seed(0))
    if layout.tp > 1:
        apply_tp(model, mesh["tp"], sw, sw.parallelize_module)
    low = {id(m.weight) for n, m in model.named_modules() if layout.float8 and gathered and is_float8_linear(m, n)}

    def size(params) -> int:
        total = 0
        for p in params:
            local = p.to_local() if hasattr(p, "to_local") else p
            rows = -(-local.shape[0] // shard) * shard
            total += rows * (local.numel() // max(local.shape[0], 1)) * (1 if id(p) in low else local.element_size())
        return total

    blocks = [size(b.parameters()) for b in model.layers]
    in_blocks = {id(p) for b in model.layers for p in b.parameters()}
    return blocks, size(p for p in model.parameters() if id(p) not in in_blocks)
