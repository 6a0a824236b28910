"""The example Llama with mixture-of-experts feed-forward blocks, and how it is parallelised.

``examples/train.py --experts 8 --top-k 2 [--ep 2]`` builds `moe_llama`: the dense Llama of
``examples/model.py`` whose every block's ``feed_forward`` is a `shardwise.composable.MoE`
(``E`` SwiGLU experts of the dense hidden width, top-k softmax routing, dropless). The
training loss adds ``AUX_COEF`` x the blocks' mean sequence-wise load-balancing loss
(`MoELlama.extra_loss`; under ``--pp`` the same loss, `MoEPipelineAux`).

`shard_moe_llama` parallelises it on an ``init_mesh(ep=N)`` mesh:

* ``--ep 1``: FSDP only; each block's unit holds its experts (every rank gathers every expert);
* ``--ep N``: the experts of each block split over the ``ep`` mesh (`ExpertParallel`), sharded
  over the ``dp_shard_mod_ep`` ranks left (`fully_shard_experts`), then every block and the root
  over the whole data-parallel mesh as in the dense example;
* ``--tp N`` (with either): tensor parallelism on attention, embedding and head (`moe_tp_plan`)
  and on the experts' own weights (`ExpertTensorParallel` on the ``(ep, tp)`` mesh: ``w1`` /
  ``w3`` column-split, ``w2`` row-split, the partial sums all-reduced over ``tp``); the router
  computes every token of the tp group on every tp rank;
* ``--pp N`` (``examples/pipeline_setup.py``, not with ``--tp``): each stage's experts split
  over the ep ranks of that stage (`shard_moe_stage`), the load-balancing loss of every stage
  entering through its gradient (`MoEPipelineAux`).

Both train on the same data with the same losses (to fp32 rounding; tests/test_example_moe.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import shardwise.composable as sw
from examples.model import Llama, LlamaConfig
from examples.parallel import _uneven, apply_fsdp, llama_tp_plan
from examples.preflight import UsageError
from shardwise.mesh import data_parallel_mesh, expert_meshes

__all__ = ["AUX_COEF", "MoELlama", "moe_llama", "moe_tp_plan", "shard_moe_llama", "check_moe_args", "shard_moe_stage",
           "MoEPipelineAux"]

AUX_COEF = 0.01
"""Weight of the load-balancing loss in the training loss."""


class MoELlama(Llama):
    """`Llama` whose blocks' ``feed_forward`` are `MoE` layers (see the module docstring)."""

    def extra_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` + ``AUX_COEF`` x the mean over blocks and sequences of the last forward's
        sequence-wise load-balancing loss (``MoE.seq_aux_loss``; the mean over sequences, so a
        pipeline's microbatches add up to the same loss, see `MoEPipelineAux`), as a replicated
        DTensor when ``loss`` is one (under ``loss_parallel`` with TP, where every tp rank routed
        the same tokens)."""
        aux = AUX_COEF * torch.stack([block.feed_forward.seq_aux_loss.mean() for block in self.layers]).mean()
        if isinstance(loss, DTensor):
            aux = DTensor.from_local(aux, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim, run_check=False)
        return loss + aux


def moe_llama(cfg: LlamaConfig, experts: int, top_k: int, generator: torch.Generator | None = None) -> MoELlama:
    """The MoE Llama: the dense model's weights from ``generator``, then each block's router and
    experts from it, in block order (the same seed gives the same model on every rank)."""
    model = MoELlama(cfg, generator=generator)
    std = cfg.init_std
    out_std = std / math.sqrt(2 * cfg.n_layers)
    for block in model.layers:
        moe = sw.MoE(cfg.dim, cfg.hidden, experts, top_k)
        with torch.no_grad():
            for w, s in ((moe.router.gate.weight, std), (moe.experts.w1, std), (moe.experts.w3, std),
                         (moe.experts.w2, out_std)):
                nn.init.trunc_normal_(w, std=s, a=-3 * s, b=3 * s, generator=generator)
        block.feed_forward = moe
    return model


def moe_tp_plan(uneven_shards: bool = False) -> dict:
    """The dense example's TP plan with the feed-forward left whole: attention (and the
    embedding, norms, head) split over ``tp``; each MoE feed-forward gathers its sequence
    shards, computes on every token (the same on every tp rank) and keeps its rank's shard of
    the output. "TP only on attention"; the experts are split by ``ep`` instead."""
    plan = {k: v for k, v in llama_tp_plan(uneven_shards=uneven_shards).items()
            if not k.startswith("layers.*.feed_forward")}
    plan["layers.*.feed_forward"] = sw.PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=Replicate(), desired_output_layouts=Shard(1), **_uneven(uneven_shards))
    return plan


def shard_moe_llama(model: MoELlama, mesh: DeviceMesh, ep: int, uneven_shards: bool = False) -> MoELlama:
    """[TP x] EP (``ep > 1``) x FSDP on an ``init_mesh(ep=ep, tp=...)`` mesh, or FSDP only
    (``ep == 1``, ``tp == 1``). With ``tp > 1`` the experts are split over ``(ep, tp)`` (also
    for ``ep == 1``: ``expert_meshes(mesh, ep=1)``, built here on every rank)."""
    tp = mesh["tp"].size()
    if tp > 1:
        sw.parallelize_module(model, mesh["tp"], moe_tp_plan(uneven_shards))
        for m in model.modules():
            if hasattr(m, "n_kv_heads"):
                m.n_heads //= tp
                m.n_kv_heads //= tp
    if ep > 1 or tp > 1:
        em = expert_meshes(mesh, ep=ep)
        style = sw.ExpertTensorParallel(em.ep_tp) if tp > 1 else sw.ExpertParallel()
        sw.parallelize_module(model, em.ep, {"layers.*.feed_forward": style})
        for block in model.layers:
            sw.fully_shard_experts(block.feed_forward, em)
    return apply_fsdp(model, data_parallel_mesh(mesh))


def check_moe_args(experts: int, top_k: int, ep: int, dp_shard: int, tp: int, pp: int) -> None:
    """`UsageError` for a flag combination the MoE example does not run."""
    if ep > 1 and not experts:
        raise UsageError(f"--ep {ep} needs experts to split: pass --experts N (a multiple of {ep})")
    if not experts:
        return
    if experts < 1 or not 1 <= top_k <= experts:
        raise UsageError(f"--top-k {top_k} must be in 1..--experts {experts}")
    if ep < 1 or dp_shard % ep or experts % ep:
        raise UsageError(f"--ep {ep} must divide the data-parallel shard ranks ({dp_shard}) and --experts "
                         f"({experts}); valid: {[d for d in range(1, dp_shard + 1) if dp_shard % d == 0 and experts % d == 0]}")
    if pp > 1 and tp > 1:
        raise UsageError("--experts with --pp runs without --tp in this example (--pp with --ep, or --tp with --ep)")


def shard_moe_stage(stage, mesh: DeviceMesh, ep: int) -> None:
    """``--pp`` with ``--ep N > 1``: split the experts of the stage's blocks over the ep mesh of
    this stage's ranks (``expert_meshes`` of the ``pp`` mesh: ``ep`` inside each stage's data-
    parallel ranks) and ``fully_shard_experts`` them; the caller then shards the blocks."""
    if ep == 1:
        return
    em = expert_meshes(mesh)
    for block in stage.blocks:
        sw.parallelize_module(block.feed_forward, em.ep, sw.ExpertParallel())
        sw.fully_shard_experts(block.feed_forward, em)


class _AddAuxGrad(torch.autograd.Function):
    """Forward: ``hidden`` unchanged; backward: ``hidden``'s gradient unchanged, and ``scale``
    as the gradient of the scalar ``aux`` (what ``scale * aux`` added to the loss would give)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_full((), ctx.scale), None


class MoEPipelineAux:
    """The load-balancing loss of `MoELlama.extra_loss` under a pipeline schedule.

    [Note: the aux loss in a pipeline]
    Only the last stage computes a loss, but every stage's routers have a load-balancing loss.
    Each MoE's output passes through `_AddAuxGrad`, which leaves the hidden state as it is and,
    when the schedule backpropagates that microbatch through the stage, adds the gradient of
    ``AUX_COEF / n_layers / m x`` the microbatch's mean sequence-wise loss to the router: the
    schedule backpropagates ``loss_i / m`` of each of ``m`` equal microbatches, and the mean over
    the rank's sequences is the mean over microbatches of their means, so the gradients, and the
    loss `take` reports, are those of ``--pp 1``. (The batch-wise loss could not be split so.)
    """

    def __init__(self, split, n_layers: int, microbatches: int) -> None:
        self.scale = AUX_COEF / n_layers / microbatches
        self.total = 0.0
        for stage in split.stages:
            for block in stage.blocks:
                block.feed_forward.register_forward_hook(self._hook)

    def _hook(self, moe: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
        aux = moe.seq_aux_loss.mean()
        if torch.is_grad_enabled():
            self.total += self.scale * float(aux.detach())
            return _AddAuxGrad.apply(out, aux, self.scale)
        return out

    def take(self, pp_group, device: torch.device) -> float:
        """The step's load-balancing term of the loss (summed over the stages; collective over
        ``pp_group``), and a fresh sum for the next step."""
        total = torch.tensor([self.total], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(total, group=pp_group)
        self.total = 0.0
        return float(total.item())
