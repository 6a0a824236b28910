"""Real models as clients: tiny Hugging Face ``transformers`` models, built from config objects
(no download), sharded with ``apply_fully_shard`` on 2 persistent workers and checked against
the same model in one process: three AdamW steps, ``generate()`` tokens, gradient
checkpointing, loading from rank 0.

transformers is imported inside the bodies: once per worker (the workers are reused from test to
test), never in the pytest process or the forkserver."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests._dist import run_on_workers

WORLD = 2
TOL = 1e-6  # fp32: the loss at every step
# Parameters after 3 AdamW steps: AdamW divides by sqrt(v), which turns the ~1e-7 gradient
# differences of summing half-batches on 2 ranks into larger ones where a gradient element is
# near 0 (attention q/o projections: up to 3e-6 measured); a real error is orders larger.
PARAM_TOL = 2e-5
# Elements whose one-process gradient stays below NOISE x the model's largest gradient at every
# step have a zero gradient in exact arithmetic (BERT's and GPT-2's attention key biases: softmax
# ignores a shift shared by all keys); AdamW moves them by rounding noise, which differs with the
# order of the sums, so they are left out of the parameter comparison (and counted).
NOISE = 1e-7
ARCHS = ("llama", "gpt2", "bert", "t5", "mixtral")


def _make(arch: str):
    """(model class, config, ShardingPolicy kwargs, is generative); dropout off, fp32, tiny."""
    import transformers as tf

    common = dict(vocab_size=48)
    if arch == "llama":
        cfg = tf.LlamaConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=32, **common)
        return tf.LlamaForCausalLM, cfg, dict(no_split_modules=True), True
    if arch == "gpt2":  # lm_head.weight is transformer.wte.weight
        cfg = tf.GPT2Config(n_embd=16, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, tie_word_embeddings=True, **common)
        return tf.GPT2LMHeadModel, cfg, dict(layer_cls="GPT2Block"), True
    if arch == "bert":  # Accelerate's TRANSFORMER_BASED_WRAP with BertLayer
        cfg = tf.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24,
                            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                            **common)
        return tf.BertForMaskedLM, cfg, dict(layer_cls="BertLayer"), False
    if arch == "t5":
        cfg = tf.T5Config(d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=2, num_heads=4,
                          dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **common)
        return tf.T5ForConditionalGeneration, cfg, dict(layer_cls="T5Block"), True
    assert arch == "mixtral", arch
    cfg = tf.MixtralConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=32, **common)
    return tf.MixtralForCausalLM, cfg, dict(layer_cls="MixtralDecoderLayer"), True


def _build(arch: str):
    cls, cfg, policy, generative = _make(arch)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(cfg), policy, generative


def _batch(arch: str, step: int, rows: slice | None = None) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(2, 48, (4, 8), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}
    if arch == "t5":
        out["labels"] = torch.randint(2, 48, (4, 5), generator=g)
    if rows is not None:
        out = {k: v[rows] for k, v in out.items()}
    return out


def _full(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach().clone())
            for n, p in model.named_parameters()}


def _check(got: dict, want: dict, tol: float, where: str) -> None:
    bad = {k: ((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)).item() for k in want}
    bad = {k: e for k, e in bad.items() if not e <= tol}
    assert got.keys() == want.keys() and not bad, f"{where}: relative error above {tol}: {bad}"


def _shard(model, policy_kw, world_size, generative: bool = False):
    from shardwise.composable import ShardingPolicy, apply_fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    apply_fully_shard(model, mesh, ShardingPolicy(**policy_kw))
    if generative:
        register_fsdp_forward_method(model, "generate")
    return model


def _train_and_generate(rank, world_size, arch, checkpointing):
    ref, policy, generative = _build(arch)
    if checkpointing:
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = _shard(copy.deepcopy(ref), policy, world_size, generative)
    on = any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
    assert on == checkpointing, f"{arch}: gradient checkpointing is {on} in the sharded model"
    ref.train(), model.train()
    opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    noise: dict[str, torch.Tensor] = {}
    moved: dict[str, torch.Tensor] = {}
    per = 4 // world_size
    losses = []
    for step in range(3):
        want = ref(**_batch(arch, step)).loss
        want.backward()
        grads = {n: p.grad.abs() for n, p in ref.named_parameters() if p.grad is not None}
        top = max(g.max() for g in grads.values())
        for n, g in grads.items():
            noise[n] = noise.get(n, torch.ones_like(g, dtype=torch.bool)) & (g < NOISE * top)
            moved[n] = moved.get(n, torch.zeros_like(g, dtype=torch.bool)) | (g > 0)
        ropt.step()
        ropt.zero_grad()
        loss = model(**_batch(arch, step, slice(rank * per, (rank + 1) * per))).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        mean /= world_size
        assert abs(mean.item() - want.item()) <= TOL * abs(want.item()), f"{arch} step {step}: {mean} vs {want}"
        losses.append(mean.item())
    got, want = _full(model), _full(ref)
    noise = {n: m & moved[n] for n, m in noise.items()}  # exact zeros leave both sides equal
    for n, mask in noise.items():
        got[n], want[n] = got[n].masked_fill(mask, 0.0), want[n].masked_fill(mask, 0.0)
    _check(got, want, PARAM_TOL, f"{arch}: parameters after 3 AdamW steps")
    n_noise = {n: int(m.sum()) for n, m in noise.items() if m.any()}
    tokens = None
    if generative:
        ref.eval(), model.eval()
        prompt = _batch(arch, 9)["input_ids"][:2, :5]
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            want, tokens = ref.generate(prompt, **kw), model.generate(prompt, **kw)
        assert torch.equal(tokens, want), f"{arch}: generate() gave {tokens.tolist()}, one process {want.tolist()}"
        tokens = tokens.tolist()
    return losses, tokens, n_noise


@pytest.mark.parametrize("arch", ARCHS)
def test_three_adamw_steps_and_generate_equal_one_process(arch):
    out = run_on_workers(_train_and_generate, WORLD, arch, False, timeout=180)
    assert out[0] == out[1], "ranks disagree"
    print(f"\n{arch}: parameter elements moved by rounding noise only, left out: {out[0][2]}")


@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_gradient_checkpointing(arch):
    """model.gradient_checkpointing_enable() (non-reentrant) on the unsharded model: same steps."""
    run_on_workers(_train_and_generate, WORLD, arch, True, timeout=180)


def _rank0_loading(rank, world_size, arch):
    from shardwise.composable import broadcast_from_rank0

    ref, policy, _ = _build(arch)
    if rank == 0:
        model, full = copy.deepcopy(ref), ref.state_dict()
    else:
        with torch.device("meta"):
            model = _build(arch)[0]
        full = None
    _shard(model, policy, world_size)
    broadcast_from_rank0(model, full)
    got = _full(model)
    bad = [k for k, v in _full(ref).items() if not torch.equal(got[k], v)]
    assert not bad, f"{arch}: rank-0 loading differs from the source in {bad}"
    return len(got)


@pytest.mark.parametrize("arch", ARCHS)
def test_rank0_loading(arch):
    """Rank 0 holds the weights, rank 1 builds on meta; broadcast_from_rank0 fills every shard
    bit-exact."""
    run_on_workers(_rank0_loading, WORLD, arch, timeout=120)
