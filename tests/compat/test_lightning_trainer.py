"""Differential: Lightning 2.6's `Trainer` (not only Fabric) with `ModelParallelStrategy`, once on
torch's FSDP2 / TP / DCP and once with those names rebound to shardwise (`tests/compat/_rebind.py`,
in every rank).

The script is Lightning's documented one for the Trainer: a `LightningModule` built under
``trainer.init_module(empty_init=True)`` (meta device) whose ``configure_model`` applies
``fully_shard`` (and, in the TP case, ``parallelize_module``) on ``self.device_mesh`` (the user's
``parallelize_fn`` of `tests/compat/test_lightning.py`); the strategy materializes it
(``to_empty`` + ``reset_parameters``). ``Trainer(accumulate_grad_batches=2)``: the first
microbatch of each step runs inside Lightning's ``_block_parallel_sync_behavior`` (its
``no_backward_sync`` path; with `ModelParallelStrategy` Lightning 2.6.6's
``block_backward_sync`` blocks only DDP, so FSDP2 still reduces after each microbatch, the same
on both implementations). Gradient clipping through the Trainer: by norm with FSDP
(``clip_grad_norm_`` over DTensor gradients on one mesh), by value with TP (with TP the
parameters live on a 1-D and a 2-D mesh, whose norms ``clip_grad_norm_`` cannot stack). With
TP the logits stay sharded by class, the loss is computed in ``loss_parallel()`` and
``LightningModule.backward`` runs inside it too. The checkpoint is the strategy's sharded one
(``trainer.save_checkpoint``: DCP for the model and the optimizer, ``meta.pt`` for the loops'
state), saved after the first epoch's last batch (2 optimizer steps); then, in fresh processes,
``trainer.fit(model, ckpt_path=...)`` resumes at step 2 and trains steps 3-4: their losses must
equal the uninterrupted run's exactly, and shardwise's losses torch's within 1e-6 relative
(fp32). Each rank asserts which implementation sharded the model (`tests/compat/_rebind.py`
``assert_ran``). torch's side is golden data (`tests/compat/_golden.py`), checked by the same
assertions as shardwise's run.
"""

from __future__ import annotations

import contextlib

from tests._compare import rel_errs
from tests._dist import run_ranks
from tests.compat._adapter import BATCH, SEQ, VOCAB, TinyLM, loss_of
from tests.compat._golden import golden, record_each, recorded_run_test
from tests.compat._rebind import assert_ran, use
from tests.compat.test_lightning import _parallelize

ACCUMULATE, STEPS_PER_EPOCH, STEPS = 2, 2, 4


def _trainer_run(rank, world_size, impl, folder, tp, resume):
    use(impl)
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.utils.data import DataLoader, TensorDataset

    def loss_context():
        return loss_parallel() if tp > 1 else contextlib.nullcontext()

    class LitLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lm = TinyLM()
            self.losses: list[float] = []
            self.start_step = -1

        def configure_model(self) -> None:
            if not isinstance(self.lm, FSDPModule):  # the Trainer may call it again
                _parallelize(self.lm, self.device_mesh)

        def on_train_start(self) -> None:
            self.start_step = self.trainer.global_step

        def training_step(self, batch, batch_idx):
            (tokens,) = batch
            with loss_context():
                loss = loss_of(self.lm, tokens)
            value = loss.detach()
            self.losses.append((value.full_tensor() if hasattr(value, "full_tensor") else value).item())
            return loss

        def backward(self, loss, *args, **kwargs) -> None:
            with loss_context():
                loss.backward(*args, **kwargs)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    class SaveAfterFirstEpoch(pl.Callback):
        """Saves where ``ModelCheckpoint(every_n_train_steps=...)`` does: after the optimizer
        step's last microbatch (Lightning resumes an ``on_train_epoch_end`` save one microbatch
        off the accumulation cycle, on torch as well)."""

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if not resume and (batch_idx + 1) % ACCUMULATE == 0 and trainer.global_step == STEPS_PER_EPOCH:
                trainer.save_checkpoint(f"{folder}/epoch0.ckpt")

    strategy = ModelParallelStrategy(data_parallel_size=world_size // tp, tensor_parallel_size=tp)
    clip = {"gradient_clip_val": 0.5} if tp == 1 else {"gradient_clip_val": 0.02, "gradient_clip_algorithm": "value"}
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, precision="32-true",
                         max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, callbacks=[SaveAfterFirstEpoch()],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0, default_root_dir=folder, **clip)
    pl.seed_everything(0, verbose=False)
    with trainer.init_module(empty_init=True):
        module = LitLM()
    assert all(p.is_meta for p in module.parameters()), "init_module(empty_init=True) did not build on meta"
    g = torch.Generator().manual_seed(1)
    # one epoch: STEPS_PER_EPOCH x ACCUMULATE microbatches of BATCH // dp rows on each dp rank
    # (Lightning's DistributedSampler over the data-parallel ranks)
    dp = world_size // tp
    tokens = torch.randint(0, VOCAB, (STEPS_PER_EPOCH * ACCUMULATE * BATCH, SEQ + 1), generator=g)
    loader = DataLoader(TensorDataset(tokens), batch_size=BATCH // dp, shuffle=False)
    trainer.fit(module, loader, ckpt_path=f"{folder}/epoch0.ckpt" if resume else None)
    not_dtensor = [n for n, p in module.named_parameters() if type(p).__name__ != "DTensor"]
    ran = assert_ran(impl, module, tp=tp > 1)  # the units (and TP hooks) are impl's, in this rank
    return {"ran": ran, "start": module.start_step, "end": trainer.global_step, "losses": module.losses, "not_dtensor": not_dtensor}


def flow(impl: str, folder: str, world: int, tp: int) -> tuple[list[dict], list[dict]]:
    first = run_ranks(_trainer_run, world, impl, folder, tp, False, timeout=240)
    second = run_ranks(_trainer_run, world, impl, folder, tp, True, timeout=240)
    return first, second


def check(impl: str, got, want, world: int, tp: int) -> None:
    """``got``: (uninterrupted, resumed) per-rank results of ``impl``; ``want``: torch's."""
    first, second = got
    micro = STEPS * ACCUMULATE
    ran = {"fsdp": [impl], "tp": [impl] if tp > 1 else []}
    for rank, (f, s, t) in enumerate(zip(first, second, want[0], strict=True)):
        where = f"{impl} rank {rank}"
        assert f["ran"] == s["ran"] == ran, f"{where}: the rank saw {f['ran']} / {s['ran']}, want {ran}"
        assert f["not_dtensor"] == [], f"{where}: parameters not sharded: {f['not_dtensor']}"
        assert f["start"] == 0 and f["end"] == STEPS and len(f["losses"]) == micro, \
            f"{where}: steps {f['start']}..{f['end']}, {len(f['losses'])} microbatches (want 0..{STEPS}, {micro})"
        assert rel_errs(f["losses"], t["losses"]) <= 1e-6, f"{where}: losses {f['losses']} vs torch's {t['losses']}"
        saved = STEPS_PER_EPOCH * ACCUMULATE
        assert s["start"] == STEPS_PER_EPOCH and s["end"] == STEPS and s["losses"] == f["losses"][saved:], \
            f"{where}: resumed at step {s['start']} with {s['losses']} vs uninterrupted {f['losses'][saved:]}"


SCENARIOS = {"lightning_trainer_fsdp": (2, 1), "lightning_trainer_tp": (2, 2)}  # golden name: (world, tp)


def _torch_side(tmp, world: int, tp: int):
    return flow("torch", str(tmp), world, tp)


record_each(SCENARIOS, _torch_side, clients=("lightning",))


test_torchs_recorded_run_passes_the_same_checks = recorded_run_test(SCENARIOS, check)


def test_trainer_fsdp_accumulation_clipping_save_resume(tmp_path):
    check("shardwise", flow("shardwise", str(tmp_path), 2, 1), golden("lightning_trainer_fsdp"), 2, 1)


def test_trainer_tp_loss_parallel_accumulation_clipping_save_resume(tmp_path):
    check("shardwise", flow("shardwise", str(tmp_path), 2, 2), golden("lightning_trainer_tp"), 2, 2)
