"""The example Llama under context parallelism (examples/cp.py through examples/train.py's
``main``): the losses of ``--cp 2`` / ``--cp 4``, alone and with ``--tp 2`` and ``--dp-shard 2``,
equal one process training on the whole global batch (fp32, 1e-6 relative), with both
attention methods; and the routing's refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.composable import context_parallel, route_attention, shard_sequence
from tests._dist import run_ranks
from tests.test_example import _main_job, _reference_losses

SEQ = 32
ARGS = ["--steps", "3", "--dim", "32", "--layers", "2", "--heads", "4", "--vocab", "64",
        "--seq-len", str(SEQ), "--batch-size", "4", "--log-every", "100"]


@pytest.mark.parametrize("world_size,extra", [
    (2, ["--cp", "2"]),
    (4, ["--cp", "4", "--cp-method", "allgather"]),
    (4, ["--cp", "2", "--tp", "2"]),
    (4, ["--cp", "2", "--dp-shard", "2"]),
], ids=["cp2", "cp4-allgather", "cp2xtp2", "cp2xdp2"])
def test_cp_training_matches_one_process(world_size, extra):
    ref = _reference_losses(steps=3, seq_len=SEQ, batch=4)
    for rank, losses in enumerate(run_ranks(_main_job, world_size, ARGS + extra, timeout=180)):
        assert len(losses) == len(ref)
        for step, (a, b) in enumerate(zip(losses, ref), 1):
            assert abs(a - b) <= 1e-6 * abs(b), f"rank {rank} step {step}: {a} vs reference {b} ({extra})"


class _Attn(torch.nn.Module):
    def forward(self, q, mask=None, dropout=0.0):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask, dropout_p=dropout, is_causal=mask is None)


def _refusals(rank, world_size):
    out = {}
    m = _Attn()
    q = torch.randn(1, 2, 4, 8)
    with context_parallel(m, None):
        for name, kw in {"mask": dict(mask=torch.ones(4, 4, dtype=torch.bool)), "dropout": dict(dropout=0.1)}.items():
            try:
                m(q, **kw)
            except ValueError as e:
                out[name] = str(e)
        routed = "forward" in m.__dict__
    out["restored"] = routed and "forward" not in m.__dict__
    h = route_attention(m, None)
    try:
        route_attention(m, None)
    except ValueError as e:
        out["twice"] = str(e)
    h.remove()
    # outside the route the same module is plain SDPA again
    out["plain"] = torch.equal(m(q), F.scaled_dot_product_attention(q, q, q, is_causal=True))
    return out


def test_route_refuses_what_it_cannot_compute_and_restores_forward():
    got = run_ranks(_refusals, 2, timeout=60)[0]
    assert "attn_mask" in got["mask"] and "is_causal=True" in got["mask"], got
    assert "dropout_p=0.1" in got["dropout"], got
    assert got["restored"] and got["plain"], got
    assert "already routed" in got["twice"], got


def _save_cp_load_plain(rank, world_size, path):
    import shardwise.checkpoint as ckpt
    from examples.cp import apply_cp, cp_shard
    from examples.data import global_batch
    from examples.model import Llama, LlamaConfig
    from examples.parallel import apply_fsdp
    from shardwise.mesh import cp_mesh, data_parallel_mesh, init_mesh

    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=32)
    mesh = init_mesh(cp=world_size, device_type="cpu")
    model = apply_fsdp(Llama(cfg, generator=torch.Generator().manual_seed(0)), data_parallel_mesh(mesh))
    apply_cp(model, cp_mesh(mesh))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs, targets, pos = cp_shard(global_batch(1, 2, 16, 64, 0), rank, world_size)
    F.cross_entropy(model(inputs, pos).flatten(0, 1), targets.flatten()).backward()
    optim.step()
    ckpt.save({"model": ckpt.get_model_state_dict(model)}, path)
    saved = {k: v.full_tensor() for k, v in ckpt.get_model_state_dict(model).items()}
    plain = apply_fsdp(Llama(cfg, generator=torch.Generator().manual_seed(1)),
                       data_parallel_mesh(init_mesh(device_type="cpu")))  # cp = 1, dp_shard = world
    state = {"model": ckpt.get_model_state_dict(plain)}
    ckpt.load(state, path)
    ckpt.set_model_state_dict(plain, state["model"])
    got = {k: v.full_tensor() for k, v in ckpt.get_model_state_dict(plain).items()}
    return sorted(saved) == sorted(got) and all(torch.equal(saved[k], got[k]) for k in saved)


def test_checkpoint_saved_under_cp_loads_without_cp(tmp_path):
    """Parameter names and values do not depend on cp: a checkpoint saved with the model
    sharded over dp_shard_cp loads bit-exact into the same model sharded over dp_shard alone."""
    assert run_ranks(_save_cp_load_plain, 2, str(tmp_path / "ck"), timeout=120) == [True, True]


def _ignored_targets(rank, world_size):
    from shardwise.composable import token_mean_loss
    from examples.cp import apply_cp, cp_shard
    from examples.data import global_batch
    from examples.model import Llama, LlamaConfig
    from examples.parallel import apply_fsdp
    from shardwise.mesh import cp_mesh, data_parallel_mesh, init_mesh

    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=32)
    tokens = global_batch(1, 2, 16, 64, 0)
    ref = Llama(cfg, generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    y[:, 9:] = -100  # the tail is padding: rank 0 (chunks 0, 3) counts far fewer tokens than rank 1
    F.cross_entropy(ref(x).flatten(0, 1), y.flatten(), ignore_index=-100).backward()

    mesh = init_mesh(cp=world_size, device_type="cpu")
    dp = data_parallel_mesh(mesh)
    model = apply_fsdp(Llama(cfg, generator=torch.Generator().manual_seed(0)), dp)
    apply_cp(model, cp_mesh(mesh))
    inputs, _, pos = cp_shard(tokens, rank, world_size)
    ys = shard_sequence(y, rank, world_size)
    loss_sum = F.cross_entropy(model(inputs, pos).flatten(0, 1), ys.flatten(), ignore_index=-100, reduction="sum")
    token_mean_loss(loss_sum, (ys != -100).sum(), dp).backward()
    worst = 0.0
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        g = p.grad.full_tensor()
        worst = max(worst, ((g - r.grad).abs().max() / r.grad.abs().max()).item())
    return worst, int((ys != -100).sum())


def test_token_mean_loss_with_unequal_token_counts():
    """Padding that leaves the cp ranks different token counts: `token_mean_loss` makes the
    averaged gradient that of the mean over every counted token of the global batch."""
    got = run_ranks(_ignored_targets, 2, timeout=120)
    assert got[0][1] != got[1][1], got  # the case really is unequal
    assert all(w <= 1e-6 for w, _ in got), got


@pytest.mark.parametrize("first,then", [
    ((2, ["--cp", "2"]), (1, [])),
    ((1, []), (2, ["--cp", "2", "--cp-method", "allgather"])),
    ((2, ["--cp", "2"]), (4, ["--cp", "2", "--pp", "2"])),
], ids=["cp2-to-cp1", "cp1-to-cp2", "cp2-to-cp2xpp2"])
def test_save_and_resume_across_cp_degrees(tmp_path, first, then):
    """``--save`` under one cp, ``--resume`` under another: the resumed steps' losses are those of
    the uninterrupted run (the one-process reference), so the model and the optimizer state
    came back whole."""
    ref = _reference_losses(steps=4, seq_len=SEQ, batch=4)
    path = str(tmp_path / "ck")
    base = ARGS[2:]  # without --steps
    saved = run_ranks(_main_job, first[0], base + ["--steps", "2", "--save", path] + first[1], timeout=180)[0]
    resumed = run_ranks(_main_job, then[0], base + ["--steps", "4", "--resume", path] + then[1], timeout=180)
    for rank, losses in enumerate(resumed):
        assert len(losses) == 2, (rank, losses)
        for step, (a, b) in enumerate(zip(saved + losses, ref), 1):
            assert abs(a - b) <= 1e-6 * abs(b), f"rank {rank} step {step}: {a} vs uninterrupted {b} ({first}, {then})"


def test_elastic_checkpoint_dir_across_cp_degrees(tmp_path):
    """``--checkpoint-dir`` with ``--cp``: 2 steps at cp 2 (2 ranks), 2 more at cp 1 (1 rank), then
    2 at cp 2 x dp_shard 2 (4 ranks) give the losses of an uninterrupted cp 1 run (model,
    optimizer and data position come back at every cp degree)."""
    from tests.test_elastic_example import SMALL, _main

    ck = str(tmp_path / "ck")
    argv = SMALL + ["--checkpoint-dir", ck]
    got = run_ranks(_main, 2, ["--steps", "2", "--cp", "2"] + argv, timeout=120)[0][0]
    got += run_ranks(_main, 1, ["--steps", "4"] + argv, timeout=120)[0][0]
    got += run_ranks(_main, 4, ["--steps", "6", "--cp", "2"] + argv, timeout=120)[0][0]
    ref = run_ranks(_main, 1, ["--steps", "6"] + SMALL + ["--checkpoint-dir", str(tmp_path / "ref")], timeout=120)
    assert len(got) == 6, got
    for step, (a, b) in enumerate(zip(got, ref[0][0]), 1):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {step}: {a} vs uninterrupted {b}"
