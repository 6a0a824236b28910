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

``build_and_shard`` builds the model from a seed and applies both.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

import shardwise.composable as sw
from examples.model import Llama, LlamaConfig


def _uneven(uneven_shards: bool) -> dict:
    """Style keywords for sequence shards of unequal lengths (a sequence length the tp size does
    not divide): shardwise's ``uneven_shards=True``; torch's styles assume equal shards."""
    return {"uneven_shards": True} if uneven_shards else {}


def block_tp_plan(styles=sw, sequence_parallel: bool = True, uneven_shards: bool = False) -> dict:
    """The TP plan of one ``TransformerBlock``. ``styles`` supplies the style classes:
    shardwise.composable, or torch's ``torch.distributed.tensor.parallel`` (same plan code).
    ``uneven_shards``: the sequence length need not divide by the tp size (shardwise only)."""
    s, u = styles, _uneven(uneven_shards)
    if not sequence_parallel:
        return {
            "attention.wq": s.ColwiseParallel(), "attention.wk": s.ColwiseParallel(),
            "attention.wv": s.ColwiseParallel(), "attention.wo": s.RowwiseParallel(),
            "feed_forward.w1": s.ColwiseParallel(), "feed_forward.w3": s.ColwiseParallel(),
            "feed_forward.w2": s.RowwiseParallel(),
        }
    return {
        "attention_norm": s.SequenceParallel(**u),
        "attention": s.PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                          desired_input_layouts=(Replicate(), None, None), **u),
        "attention.wq": s.ColwiseParallel(), "attention.wk": s.ColwiseParallel(),
        "attention.wv": s.ColwiseParallel(), "attention.wo": s.RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": s.SequenceParallel(**u),
        "feed_forward": s.PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), **u),
        "feed_forward.w1": s.ColwiseParallel(), "feed_forward.w3": s.ColwiseParallel(),
        "feed_forward.w2": s.RowwiseParallel(output_layouts=Shard(1)),
    }


def llama_tp_plan(styles=sw, uneven_shards: bool = False) -> dict:
    """The TP plan of the whole ``Llama``: vocab-parallel embedding, sequence-parallel blocks,
    class-sharded output for ``loss_parallel``; ``uneven_shards`` as in `block_tp_plan`."""
    s, u = styles, _uneven(uneven_shards)
    plan = {
        "tok_embeddings": s.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": s.SequenceParallel(**u),
        "output": s.ColwiseParallel(input_layouts=Shard(1), use_local_output=False, **u),
    }
    plan.update({f"layers.*.{k}": v for k, v in block_tp_plan(s, True, uneven_shards).items()})
    return plan


def apply_tp(model, tp_mesh: DeviceMesh, uneven_shards: bool = False):
    """Tensor-parallelise ``model`` on the 1-D ``tp_mesh``. Attention reshapes by its head
    counts, so each rank's counts become ``1/tp`` of them (they must divide).
    ``uneven_shards=True`` when the sequence length is not a multiple of the tp size."""
    tp = tp_mesh.size()
    for m in model.modules():
        if hasattr(m, "n_kv_heads"):
            if m.n_heads % tp or m.n_kv_heads % tp:
                raise ValueError(f"--tp {tp} must divide the heads ({m.n_heads}) and kv heads ({m.n_kv_heads})")
    sw.parallelize_module(model, tp_mesh, llama_tp_plan(uneven_shards=uneven_shards))
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


def build_and_shard(
    cfg: LlamaConfig, dp_mesh: DeviceMesh, *, seed: int = 0, tp_mesh: DeviceMesh | None = None,
    uneven_shards: bool = False, **shard_kwargs
) -> Llama:
    """Build :class:`Llama` from ``seed`` (identical on every rank), tensor-parallelise it on
    ``tp_mesh`` when given (``apply_tp``), then shard it on ``dp_mesh`` (``apply_fsdp``: each
    block, then the root). A 2-D ``dp_mesh`` (``dp_replicate x dp_shard``) gives HSDP.
    ``shard_kwargs`` go to every ``fully_shard`` call (e.g. ``reshard_after_forward``);
    ``uneven_shards``: the sequence length is not a multiple of the tp size (``apply_tp``).
    """
    model = Llama(cfg, generator=torch.Generator().manual_seed(seed))
    if tp_mesh is not None and tp_mesh.size() > 1:
        apply_tp(model, tp_mesh, uneven_shards=uneven_shards)
    return apply_fsdp(model, dp_mesh, **shard_kwargs)
