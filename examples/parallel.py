"""How the example Llama is parallelised: ``apply_tp`` on the ``tp`` axis, then ``apply_fsdp``
on the data-parallel axes of the same mesh (the torchtitan order: TP inside, FSDP outside).

The TP plan is Megatron-style with sequence parallelism:

* ``tok_embeddings``: vocabulary-parallel (``E = [E_1; ...; E_p]`` by rows), output sharded on
  the sequence dim (reduce-scatter);
* per block: norms on sequence shards (``SequenceParallel``), q/k/v and w1/w3 column-parallel
  (``Y = X [W_1 ... W_p]``, heads split over tp), wo and w2 row-parallel
  (``Y = sum_i X_i W_i``, reduce-scattered back to sequence shards);
* ``output``: column-parallel over the vocabulary, logits stay class-sharded for
  ``loss_parallel`` (the vocabulary is never gathered).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

import shardwise.composable as sw


def block_tp_plan(styles=sw, sequence_parallel: bool = True) -> dict:
    """The TP plan of one ``TransformerBlock``. ``styles`` supplies the style classes:
    shardwise.composable, or torch's ``torch.distributed.tensor.parallel`` (same plan code)."""
    s = styles
    if not sequence_parallel:
        return {
            "attention.wq": s.ColwiseParallel(), "attention.wk": s.ColwiseParallel(),
            "attention.wv": s.ColwiseParallel(), "attention.wo": s.RowwiseParallel(),
            "feed_forward.w1": s.ColwiseParallel(), "feed_forward.w3": s.ColwiseParallel(),
            "feed_forward.w2": s.RowwiseParallel(),
        }
    return {
        "attention_norm": s.SequenceParallel(),
        "attention": s.PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                          desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": s.ColwiseParallel(), "attention.wk": s.ColwiseParallel(),
        "attention.wv": s.ColwiseParallel(), "attention.wo": s.RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": s.SequenceParallel(),
        "feed_forward": s.PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": s.ColwiseParallel(), "feed_forward.w3": s.ColwiseParallel(),
        "feed_forward.w2": s.RowwiseParallel(output_layouts=Shard(1)),
    }


def llama_tp_plan(styles=sw) -> dict:
    """The TP plan of the whole ``Llama``: vocab-parallel embedding, sequence-parallel blocks,
    class-sharded output for ``loss_parallel``."""
    s = styles
    plan = {
        "tok_embeddings": s.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": s.SequenceParallel(),
        "output": s.ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    }
    plan.update({f"layers.*.{k}": v for k, v in block_tp_plan(s, True).items()})
    return plan


def apply_tp(model, tp_mesh: DeviceMesh):
    """Tensor-parallelise ``model`` on the 1-D ``tp_mesh``. Attention reshapes by its head
    counts, so each rank's counts become ``1/tp`` of them (they must divide)."""
    tp = tp_mesh.size()
    for m in model.modules():
        if hasattr(m, "n_kv_heads"):
            if m.n_heads % tp or m.n_kv_heads % tp:
                raise ValueError(f"--tp {tp} must divide the heads ({m.n_heads}) and kv heads ({m.n_kv_heads})")
    sw.parallelize_module(model, tp_mesh, llama_tp_plan())
    for m in model.modules():
        if hasattr(m, "n_kv_heads"):
            m.n_heads //= tp
            m.n_kv_heads //= tp
    return model


def apply_fsdp(model, dp_mesh: DeviceMesh, **shard_kwargs):
    """``fully_shard`` each block, then the root (embedding, final norm, head)."""
    for block in model.layers:
        sw.fully_shard(block, mesh=dp_mesh, **shard_kwargs)
    sw.fully_shard(model, mesh=dp_mesh, **shard_kwargs)
    return model
