"""Behaviours torch's FSDP2 unit tests pin down, each against a single-process reference:
unused parameters keep ``.grad`` None, activation checkpointing around a unit under mixed
precision, ``state_dict()`` after a forward that left parameters unsharded, parameters
replaced after a meta-device ``fully_shard``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from shardwise.composable import MixedPrecisionPolicy, fully_shard
from tests._compare import maxerr
from tests._dist import run_ranks
from tests._models import Net, batches, loss_fn, make_mesh, max_param_error

TOL = 1e-6


# -- unused parameters ---------------------------------------------------------------------------
class AdapterNet(Net):
    """``adapter`` is used only where ``use_adapter(rank, step)`` says so; ``spare`` never."""

    def __init__(self) -> None:
        super().__init__()
        self.adapter = nn.Linear(6, 6)
        self.blocks[0].spare = nn.Linear(6, 6)  # inside a block's unit, never called
        self.use_adapter = True

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        if self.use_adapter:
            x = x + self.adapter(x)
        return self.head(x) * self.scale.sum()


def _unused(rank, world_size, mesh_shape, policy, accumulate):
    torch.manual_seed(0)
    ref = AdapterNet()
    model = copy.deepcopy(ref)
    mesh = make_mesh(mesh_shape)
    dp_rank, dp = rank, world_size
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    per = 8 // dp
    worst, none_grads = 0.0, []
    for step, (tokens, target) in enumerate(batches(3, 8)):
        # the reference sees each rank's rows with that rank's choice (summed as the mean)
        ref_loss = 0.0
        for r in range(dp):
            ref.use_adapter = policy(r, step)
            sl = slice(r * per, (r + 1) * per)
            loss = loss_fn(ref(tokens[sl]), target[sl]) / dp
            loss.backward()
            ref_loss += loss.item()
        ref_none = sorted(n for n, p in ref.named_parameters() if p.grad is None)
        ropt.step()
        ropt.zero_grad()
        model.use_adapter = policy(dp_rank, step)
        sl = slice(dp_rank * per, (dp_rank + 1) * per)
        if accumulate:  # two micro-batches: the first without the replica all-reduce
            half = per // 2
            model.set_requires_all_reduce(False)
            loss_fn(model(tokens[sl][:half]), target[sl][:half]).div(2).backward()
            model.set_requires_all_reduce(True)
            loss_fn(model(tokens[sl][half:]), target[sl][half:]).div(2).backward()
            loss = torch.tensor(ref_loss)  # the per-rank loss is checked without accumulation
        else:
            loss = loss_fn(model(tokens[sl]), target[sl])
            loss.backward()
        none_grads.append((ref_none, sorted(n for n, p in model.named_parameters() if p.grad is None)))
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if not accumulate:
            dist.all_reduce(mean)
            mean /= world_size
        worst = max(worst, abs(mean.item() - ref_loss) / abs(ref_loss))
    return worst, max_param_error(ref, model), none_grads


def _never(r, step):
    return False


def _rank0_only(r, step):
    return r == 0


def _odd_steps(r, step):
    return step % 2 == 1


@pytest.mark.parametrize("policy", [_never, _rank0_only, _odd_steps], ids=["unused", "rank0-only", "odd-steps"])
@pytest.mark.parametrize("mesh_shape,accumulate", [((2,), False), ((2, 2), False), ((2, 2), True)],
                         ids=["fsdp2", "hsdp2x2", "hsdp2x2-accumulate"])
def test_unused_parameters_keep_grad_none(policy, mesh_shape, accumulate):
    """FSDP2 leaves an unused parameter's ``.grad`` None, so AdamW's weight decay does not
    move it; ranks that disagree still reduce together (the used ones' mean)."""
    world = 1
    for d in mesh_shape:
        world *= d
    for rank, (loss_err, errs, nones) in enumerate(run_ranks(_unused, world, mesh_shape, policy, accumulate)):
        assert loss_err <= TOL, f"rank {rank}: loss differs by {loss_err:.2e}"
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: parameters differ from one process: {bad}"
        for step, (ref_none, ours) in enumerate(nones):
            assert ref_none == ours, f"rank {rank} step {step}: .grad None on one process {ref_none}, here {ours}"


def _unused_zero(rank, world_size):
    torch.manual_seed(0)
    model = AdapterNet()
    model.use_adapter = False
    mesh = make_mesh((world_size,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_reduce_scatter_unused_params(True)
    tokens, target = batches(1, 4)[0]
    loss_fn(model(tokens), target).backward()
    return {n: (p.grad is not None and p.grad.full_tensor().abs().max().item())
            for n, p in model.named_parameters() if n.startswith(("adapter", "blocks.0.spare"))}


def test_reduce_scatter_unused_params_gives_zero_grads():
    for out in run_ranks(_unused_zero, 2):
        assert out and all(v is not False and v == 0 for v in out.values()), f"expected zero gradients: {out}"


# -- activation checkpointing under mixed precision ---------------------------------------------------
class CheckpointedUnits(Net):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant)
        # the head is in the root's unit (bf16 parameters): fp32 block outputs come back down
        return self.head(x.to(self.scale.dtype)) * self.scale.sum()


def _ac_mixed_precision(rank, world_size, reentrant, output_dtype, root_dtype):
    torch.manual_seed(0)
    ref = CheckpointedUnits(reentrant)
    model = copy.deepcopy(ref)
    mesh = make_mesh((world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=output_dtype)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, mp_policy=mp)
    root_bf16 = root_dtype == torch.bfloat16
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if root_bf16 else None, reduce_dtype=torch.float32,
        output_dtype=torch.float32 if root_bf16 else None))
    seen = []
    model.blocks[1].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    # the reference: one process, no checkpointing, each unit's parameters in its compute dtype
    low = copy.deepcopy(ref).to(root_dtype)
    low.blocks.to(torch.bfloat16)
    tokens, target = batches(1, 4)[0]
    x = low.emb(tokens)
    for b in low.blocks:
        x = b(x.to(torch.bfloat16))
        if output_dtype is not None:
            x = x.to(output_dtype)
    ref_out = (low.head(x.to(root_dtype)) * low.scale.sum()).float()
    ref_loss = loss_fn(ref_out, target)
    ref_loss.backward()
    out = model(tokens)
    loss = loss_fn(out, target)
    loss.backward()
    grad_errs = {}
    ref_params = dict(low.named_parameters())
    for n, p in model.named_parameters():
        g = p.grad.full_tensor()
        r = ref_params[n].grad.float()
        grad_errs[n] = ((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
    return abs(loss.item() - ref_loss.item()), out.dtype, seen, grad_errs


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("output_dtype", [None, torch.float32], ids=["bf16-out", "fp32-out"])
@pytest.mark.parametrize("root_dtype", [torch.bfloat16, torch.float32], ids=["bf16-root", "fp32-root"])
def test_activation_checkpointed_unit_under_bf16(reentrant, output_dtype, root_dtype):
    """``checkpoint(unit, x)`` with a bf16 policy: the recomputation casts inputs and outputs
    as the first forward did, so backward runs (no dtype mismatch) and gradients match."""
    for rank, (loss_err, dtype, seen, grad_errs) in enumerate(
            run_ranks(_ac_mixed_precision, 2, reentrant, output_dtype, root_dtype)):
        want = output_dtype or torch.bfloat16
        assert all(d == want for d in seen), f"rank {rank}: unit outputs {seen}, policy says {want}"
        assert dtype == torch.float32, f"rank {rank}: root output {dtype}, fp32 asked"
        # bf16 compute: one process in bf16 is the reference, to bf16 resolution
        assert loss_err <= 1e-2, f"rank {rank}: loss differs by {loss_err:.2e}"
        bad = {k: v for k, v in grad_errs.items() if not v <= 2e-2}
        assert not bad, f"rank {rank}: gradients differ from one bf16 process: {bad}"


# -- state_dict() after a forward that left parameters unsharded --------------------------------------
def _state_dict_mid_step(rank, world_size, raf):
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    mesh = make_mesh((world_size,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=raf)
    fully_shard(model, mesh=mesh)  # the root keeps its parameters after forward by default
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per = 8 // world_size
    problems, worst = [], 0.0
    for tokens, target in batches(2, 8):
        sl = slice(rank * per, (rank + 1) * per)
        out = model(tokens[sl])
        # mid-step: after forward, before backward; the whole model and one leaf module
        for where, sd in (("model", model.state_dict()), ("blocks.0.up", model.blocks[0].up.state_dict())):
            for k, v in sd.items():
                if not isinstance(v, DTensor):
                    problems.append(f"{where}: {k} is a {type(v).__name__}, not a sharded DTensor")
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        ref_sd = ref.state_dict()
        problems += [f"{k} differs from one process" for k, v in full.items()
                     if (v - ref_sd[k]).abs().max() > TOL * ref_sd[k].abs().max().clamp_min(1e-12)]
        loss = loss_fn(out, target[sl])
        loss.backward()  # the resharded root gathers again for its backward
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn(ref(tokens), target)
        ref_loss.backward()
        ropt.step()
        ropt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        worst = max(worst, abs(mean.item() / world_size - ref_loss.item()) / abs(ref_loss.item()))
    return problems, worst, max_param_error(ref, model)


@pytest.mark.parametrize("raf", [True, False])
def test_state_dict_after_forward_is_sharded(raf):
    """FSDP2 reshards in a state-dict pre-hook: a state dict taken between forward and
    backward holds the sharded DTensors, and the step then goes on unchanged."""
    for rank, (problems, loss_err, errs) in enumerate(run_ranks(_state_dict_mid_step, 2, raf)):
        assert not problems, f"rank {rank}: {problems[:5]}"
        assert loss_err <= TOL, f"rank {rank}: loss differs by {loss_err:.2e}"
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: parameters differ: {bad}"


# -- parameters replaced after a meta-device fully_shard ---------------------------------------------
def _replaced_after_meta(rank, world_size, how):
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    ref = Net()
    with torch.device("meta"):
        model = Net()
    mesh = make_mesh((world_size,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    if how == "leave-one":
        names.remove("head.weight")
    for name in names:  # the re-init pattern: a new Parameter per name, from the sharded one's layout
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        old = getattr(mod, attr)
        setattr(mod, attr, nn.Parameter(distribute_tensor(ref_params[name].detach().clone(), old.device_mesh,
                                                          old.placements)))
    for n, buf in ref.named_buffers():
        model.get_submodule(n.rpartition(".")[0]).register_buffer(n.rpartition(".")[2], buf.clone())
    tokens, target = batches(1, 8)[0]
    per = 8 // world_size
    sl = slice(rank * per, (rank + 1) * per)
    try:
        loss = loss_fn(model(tokens[sl]), target[sl])
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return type(e).__name__, str(e)
    loss.backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    loss_fn(ref(tokens), target).backward()
    ropt.step()
    return "ok", max_param_error(ref, model)


def test_parameter_replaced_after_meta_fully_shard_is_adopted():
    for rank, (status, errs) in enumerate(run_ranks(_replaced_after_meta, 2, "all")):
        assert status == "ok", f"rank {rank}: {status}: {errs}"
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: parameters differ: {bad}"


def test_parameters_still_on_meta_are_named():
    for rank, (status, msg) in enumerate(run_ranks(_replaced_after_meta, 2, "leave-one")):
        assert status == "RuntimeError" and "head.weight" in msg and "to_empty" in msg, \
            f"rank {rank}: {status}: {msg}"


def _host_reads(rank, world_size, use_adapter):
    import shardwise.composable._fsdp._root as root_mod

    torch.manual_seed(0)
    model = AdapterNet()
    del model.blocks[0].spare  # every parameter used when use_adapter
    model.use_adapter = use_adapter
    mesh = make_mesh((world_size,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    real, candidates = root_mod.resolve_unused, []
    root_mod.resolve_unused = lambda done: (candidates.append(
        sorted(i for pr in done if pr.unused_check for i in pr.unused_check[2])), real(done))[1]
    try:
        tokens, target = batches(1, 4)[0]
        loss_fn(model(tokens), target).backward()
    finally:
        root_mod.resolve_unused = real
    return candidates


def test_a_step_that_uses_every_parameter_reads_no_counts():
    """[Note: unused parameters]: counts are read only for parameters this rank had no
    gradient for, so the usual step costs no host read; an unused one is still a candidate."""
    for rank, cands in enumerate(run_ranks(_host_reads, 2, True)):
        assert cands == [[]], f"rank {rank}: counts to read {cands}"
    for rank, cands in enumerate(run_ranks(_host_reads, 2, False)):
        assert cands and cands[0], f"rank {rank}: the unused adapter is not checked: {cands}"
