"""Differential: torchtitan 0.2.2's llama3 training flow, once on torch's FSDP2 / TP / DCP and
once with those names rebound to shardwise (`tests/compat/_rebind.py`, in every rank).

torchtitan's `Trainer` picks CUDA, so `_train` drives torchtitan's own builders as
``Trainer.__init__`` / ``train_step`` / ``train`` do, on CPU gloo, with nothing of the flow
replaced: the llama3 debug model built on the meta device, its `parallelize_llama` (default
selective activation checkpointing; `fully_shard` of the embedding, of each block, of
``[norm, output]`` as one unit, then of the root), `ParallelDims` (every mesh built by
``DeviceMesh._unflatten`` of the 1-D world mesh), ``to_empty`` + ``init_weights``, its
optimizer and LR builders, its ``loss_parallel`` train context, its `clip_grad_norm_`, and its
`CheckpointManager` with its `ParallelAwareDataloader` (whose state is ``bytes`` per dp rank).
The only changes: torchtitan's ``device_type`` set to ``"cpu"``, its MoE Triton kernels module
stubbed (the flow never calls it; importing it needs Triton), a tiny synthetic stateful
dataset instead of C4 with a tokenizer, and ``set_force_sum_reduction_for_comms(True)`` on every
FSDP unit after `parallelize_llama`: torchtitan sets ``set_gradient_divide_factor(1.0)``, with
which torch's FSDP2 reduce-scatters with ``ReduceOp.PREMUL_SUM``, which gloo lacks ("Cannot use
ReduceOp.PREMUL_SUM with Gloo"); with force-sum it sums and divides by 1, the same gradients.

Scenario: train 4 steps (checkpoint interval 2, so step 2 and step 4 are saved); then, in fresh
processes, remove step 4 (a job that died after step 2's save) and resume the way
``Trainer.train`` does (``checkpointer.load()`` finds the newest checkpoint itself): it must
start at step 2 and train steps 3-4 with the uninterrupted run's losses. fp32; torch's losses
and shardwise's must agree within 1e-6 relative, each resume exactly. Each rank asserts which
implementation sharded the model (`tests/compat/_rebind.py` ``assert_ran``). torch's side is
golden data (`tests/compat/_golden.py`: ``python -m tests.compat.regen_goldens torchtitan_fsdp
torchtitan_fsdp_tp`` reruns it), checked by the same assertions as shardwise's run.
"""

from __future__ import annotations

import shutil
import sys
import types

from tests._compare import rel_errs
from tests._dist import run_ranks
from tests.compat._golden import golden, record_each, recorded_run_test
from tests.compat._rebind import assert_ran, use

# ranks import torchtitan after `use`; this process never imports it

STEPS, SAVE_AT, SEQ, BATCH, VOCAB = 4, 2, 32, 2, 2048


def _stub_moe_kernels() -> None:
    """torchtitan's package import reaches ``torchtitan.models.moe.kernels``, which imports
    Triton (GPU only, not a torchtitan dependency). The dense llama3 flow never calls it."""
    name = "torchtitan.models.moe.kernels"
    if name not in sys.modules:
        stub = types.ModuleType(name)

        def _unavailable(*a, **k):
            raise RuntimeError("torchtitan's Triton MoE kernels are stubbed in this test")

        stub.generate_permute_indices = stub.fill_indices_wrapper = _unavailable  # type: ignore[attr-defined]
        sys.modules[name] = stub


def _dataset(dp_rank: int):
    """Token batches, deterministic per (dp rank, position), Stateful like torchtitan's
    HuggingFaceTextDataset: its position is in the data loader's checkpointed state."""
    import torch
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.utils.data import IterableDataset

    class Tokens(IterableDataset, Stateful):
        def __init__(self) -> None:
            self.pos = 0

        def __iter__(self):
            while True:
                g = torch.Generator().manual_seed(1000 * dp_rank + self.pos)
                self.pos += 1
                t = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
                yield {"input": t[:-1]}, t[1:]

        def state_dict(self):
            return {"pos": self.pos}

        def load_state_dict(self, state):
            self.pos = state["pos"]

    return Tokens()


def _train(rank, world_size, impl, folder, tp, resume, meta=True):
    use(impl)
    _stub_moe_kernels()
    import torch

    import torchtitan.distributed.parallel_dims as pd_mod
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tt_utils
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.loss import IGNORE_INDEX, build_cross_entropy_loss
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import Transformer, llama3_args, parallelize_llama

    for mod in (pd_mod, dist_utils, tt_utils):  # the trainer's device is CUDA; here the CPU
        mod.device_type = "cpu"
    device = torch.device("cpu")

    job = JobConfig()
    job.training.local_batch_size, job.training.seq_len, job.training.steps = BATCH, SEQ, STEPS
    job.training.mixed_precision_param = "float32"
    job.parallelism.tensor_parallel_degree = tp
    job.lr_scheduler.warmup_steps = 2
    job.optimizer.lr = 1e-3
    job.debug.seed = 0
    job.checkpoint.enable, job.checkpoint.interval = True, SAVE_AT
    job.checkpoint.last_save_model_only = False
    job.job.dump_folder = folder

    # Trainer.init_distributed (the harness has joined the gloo group)
    par = job.parallelism
    parallel_dims = ParallelDims(dp_shard=par.data_parallel_shard_degree, dp_replicate=par.data_parallel_replicate_degree,
                                 cp=par.context_parallel_degree, tp=par.tensor_parallel_degree,
                                 pp=par.pipeline_parallel_degree, ep=par.expert_parallel_degree,
                                 etp=par.expert_tensor_parallel_degree, world_size=world_size)
    batch_mesh = parallel_dims.get_mesh("batch")
    dp_degree, dp_rank = batch_mesh.size(), batch_mesh.get_local_rank()
    dist_utils.set_determinism(parallel_dims, device, job.debug, distinct_seed_mesh_dims=["pp"])
    dataloader = ParallelAwareDataloader(_dataset(dp_rank), dp_rank=dp_rank, dp_world_size=dp_degree,
                                         batch_size=BATCH)

    model_args = llama3_args["debugmodel"]
    model_args.update_from_config(job)
    with torch.device("meta" if meta else "cpu"):
        model = Transformer(model_args)
    loss_fn = build_cross_entropy_loss(job, parallel_dims=parallel_dims)
    model = parallelize_llama(model, parallel_dims, job)
    from torch.distributed.fsdp import FSDPModule  # rebound by `use` for shardwise

    for m in model.modules():  # gloo has no PREMUL_SUM: see the module docstring
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    ran = assert_ran(impl, model, tp=tp > 1)  # the units (and TP hooks) are impl's, in this rank
    if meta:
        model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    model_parts = [model]
    optimizers = build_optimizers(model_parts, job.optimizer, parallel_dims)
    lr_schedulers = build_lr_schedulers(optimizers, job.lr_scheduler, job.training.steps)

    class TrainState:  # the Trainer's own Stateful part
        step = 0
        ntokens_seen = 0

        def state_dict(self):
            return {"step": self.step, "ntokens_seen": self.ntokens_seen}

        def load_state_dict(self, sd):
            self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]

    state = TrainState()
    checkpointer = CheckpointManager(dataloader=dataloader, model_parts=model_parts, optimizers=optimizers,
                                     lr_schedulers=lr_schedulers, states={"train_state": state},
                                     checkpoint_config=job.checkpoint, sd_adapter=None, base_folder=folder)
    train_context = dist_utils.get_train_context(parallel_dims.tp_enabled and not par.disable_loss_parallel)

    # Trainer.train
    if resume and rank == 0:
        shutil.rmtree(f"{checkpointer.folder}/step-{STEPS}")  # the job died after step SAVE_AT's save
    torch.distributed.barrier()
    loaded = checkpointer.load(step=job.checkpoint.load_step)
    out = {"ran": ran, "loaded": loaded, "start": state.step, "losses": [], "grad_norms": [],
           "mesh_ndims": sorted({p.device_mesh.ndim for p in model.parameters()})}
    data = iter(dataloader)
    while state.step < job.training.steps:
        state.step += 1
        # Trainer.train_step (one microbatch: global batch = local batch x dp degree)
        optimizers.zero_grad()
        inputs, labels = next(data)
        state.ntokens_seen += labels.numel()
        global_valid = dist_utils.dist_sum((labels != IGNORE_INDEX).sum(), batch_mesh)
        with train_context():
            pred = model(inputs["input"])
            loss = loss_fn(pred, labels) / global_valid
            del pred
            loss.backward()
        out["loss_type"] = type(loss).__name__  # a DTensor inside loss_parallel
        grad_norm = dist_utils.clip_grad_norm_([p for m in model_parts for p in m.parameters()],
                                               job.training.max_norm, foreach=True,
                                               pp_mesh=parallel_dims.get_optional_mesh("pp"),
                                               ep_enabled=parallel_dims.ep_enabled)
        optimizers.step()
        lr_schedulers.step()
        out["losses"].append(dist_utils.dist_sum(loss.detach(), parallel_dims.get_optional_mesh("loss")))
        out["grad_norms"].append(grad_norm.item())
        checkpointer.save(state.step, last_step=(state.step == job.training.steps))
    checkpointer.close()
    return out


def flow(impl: str, folder: str, world: int, tp: int) -> tuple[dict, dict]:
    """The uninterrupted run, then the resumed one (fresh processes); rank 0's results."""
    timeout = 150 * world  # 4 ranks on 2 shared cores: a resume took over 300 s at load average 30
    first = run_ranks(_train, world, impl, folder, tp, False, timeout=timeout)[0]
    second = run_ranks(_train, world, impl, folder, tp, True, timeout=timeout)[0]
    return first, second


def check(impl: str, got, want, world: int, tp: int) -> None:
    """``got``: (uninterrupted, resumed) rank-0 results of ``impl``; ``want``: torch's."""
    first, second = got
    t_first, _ = want
    ndims = [2] if tp > 1 else [1]  # with TP every parameter is on the 2-D (dp, tp) mesh
    ran = {"fsdp": [impl], "tp": [impl] if tp > 1 else []}
    assert first["ran"] == second["ran"] == ran, f"{impl}: the ranks saw {first['ran']} / {second['ran']}, want {ran}"
    assert first["mesh_ndims"] == ndims and first["loss_type"] == ("DTensor" if tp > 1 else "Tensor"), \
        f"{impl}: parameters on {first['mesh_ndims']}-D meshes (want {ndims}), the loss a {first['loss_type']}"
    assert not first["loaded"] and first["start"] == 0, f"{impl}: the first run found a checkpoint: {first}"
    assert len(first["losses"]) == STEPS
    assert rel_errs(first["losses"], t_first["losses"]) <= 1e-6, \
        f"{impl}: losses {first['losses']} vs torch's {t_first['losses']}"
    assert second["loaded"] and second["start"] == SAVE_AT, \
        f"{impl}: resume did not start at the saved step {SAVE_AT}: loaded={second['loaded']} start={second['start']}"
    assert second["losses"] == first["losses"][SAVE_AT:], \
        f"{impl}: resumed losses {second['losses']} vs uninterrupted {first['losses'][SAVE_AT:]}"


SCENARIOS = {"torchtitan_fsdp": (2, 1), "torchtitan_fsdp_tp": (4, 2)}  # golden name: (world, tp)


def _torch_side(tmp, world: int, tp: int):
    return flow("torch", str(tmp), world, tp)


record_each(SCENARIOS, _torch_side, clients=("torchtitan",))


test_torchs_recorded_run_passes_the_same_checks = recorded_run_test(SCENARIOS, check)


def test_fsdp2_meta_init_list_units_checkpoint_resume(tmp_path):
    check("shardwise", flow("shardwise", str(tmp_path), 2, 1), golden("torchtitan_fsdp"), 2, 1)


def test_fsdp2_x_tp2_loss_parallel_checkpoint_resume(tmp_path):
    """4 ranks, ``dp_shard=2 x tp=2`` (``ParallelDims`` unflattens the world mesh into both):
    `parallelize_llama` applies its TP plan (sequence-parallel norms, colwise/rowwise
    projections, the output's logits sharded by vocabulary) before `fully_shard` on the 2-D
    mesh's dp axis; the loss is computed inside its ``loss_parallel`` train context, the
    gradient norm clipped by its `clip_grad_norm_` over parameters on the 2-D mesh."""
    check("shardwise", flow("shardwise", str(tmp_path), 4, 2), golden("torchtitan_fsdp_tp"), 4, 2)
