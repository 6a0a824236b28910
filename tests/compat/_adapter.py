"""The differential suite's adapter: one scenario, two implementations.

Every scenario in ``tests/compat`` is written once against `Impl`, whose fields are the names a
user's script calls, and runs once with torch's implementation (``torch.distributed.fsdp``,
``torch.distributed.tensor.parallel``, ``torch.distributed.checkpoint``) and once with
shardwise's. Both are checked against the same single-process reference. Rule of the suite:
wherever torch's implementation passes, shardwise's must pass too.

Also here: the model every scenario uses (`TinyLM`: embedding, transformer blocks with
attention and an MLP, head; heads and hidden sizes split over 2 TP ranks), its TP plan, the
data, a training step, and comparisons.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from tests._compare import rel_errs

IMPLS = ("torch", "shardwise")


@dataclass(frozen=True)
class Impl:
    """What a script calls. ``save``/``load`` take ``(state, path)``; state dicts are got and set
    with the ``*_state_dict`` helpers around them."""

    name: str
    fully_shard: Callable
    FSDPModule: type
    MixedPrecisionPolicy: type
    parallelize_module: Callable
    ColwiseParallel: type
    RowwiseParallel: type
    save: Callable
    load: Callable
    get_model_state_dict: Callable
    get_optimizer_state_dict: Callable
    set_model_state_dict: Callable
    set_optimizer_state_dict: Callable
    # tensor parallelism beyond Colwise/Rowwise (filled by `_tp_names`)
    SequenceParallel: Any = None
    PrepareModuleInput: Any = None
    PrepareModuleOutput: Any = None
    PrepareModuleInputOutput: Any = None
    ParallelStyle: Any = None
    loss_parallel: Any = None


def _tp_names(name: str) -> dict[str, Any]:
    """The TP names of torch's public API (``torch.distributed.tensor.parallel.__all__``) that
    `Impl` holds besides parallelize_module and Colwise/Rowwise, from one implementation."""
    if name == "torch":
        import torch.distributed.tensor.parallel as mod
    else:
        import shardwise.composable as mod  # type: ignore[no-redef]
    keys = ("SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput",
            "ParallelStyle", "loss_parallel")
    return {k: getattr(mod, k) for k in keys}


def impl(name: str) -> Impl:
    """The implementation called ``name`` (one of `IMPLS`); imported on first use."""
    if name == "torch":
        import torch.distributed.checkpoint as dcp
        import torch.distributed.checkpoint.state_dict as sd
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        return replace(Impl("torch", fully_shard, FSDPModule, MixedPrecisionPolicy, parallelize_module, ColwiseParallel,
                    RowwiseParallel, lambda state, path: dcp.save(state, checkpoint_id=path),
                    lambda state, path: dcp.load(state, checkpoint_id=path), sd.get_model_state_dict,
                    sd.get_optimizer_state_dict, sd.set_model_state_dict, sd.set_optimizer_state_dict),
                       **_tp_names("torch"))
    if name == "shardwise":
        import shardwise.checkpoint as ck
        import shardwise.composable as sw

        return replace(Impl("shardwise", sw.fully_shard, sw.FSDPModule, sw.MixedPrecisionPolicy, sw.parallelize_module,
                    sw.ColwiseParallel, sw.RowwiseParallel, ck.save, ck.load, ck.get_model_state_dict,
                    ck.get_optimizer_state_dict, ck.set_model_state_dict, ck.set_optimizer_state_dict),
                       **_tp_names("shardwise"))
    raise ValueError(f"unknown implementation {name!r}; use one of {IMPLS}")


# -- the model -------------------------------------------------------------------------------------
VOCAB, DIM, HEADS, HIDDEN, SEQ, BATCH = 16, 16, 4, 24, 6, 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        # -1 heads: with the q/k/v columns split over TP ranks, each rank has its share of heads
        q, k, v = (m(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))

    def init_weights(self) -> None:
        """torchtitan's idiom: (re)initialise every parameter in place."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.LayerNorm, nn.Embedding)):
                m.reset_parameters()


def tp_plan(i: Impl) -> dict:
    """Megatron split of a block: q/k/v and w1 by columns, o and w2 by rows."""
    col, row = i.ColwiseParallel, i.RowwiseParallel
    return {"attn.q": col(), "attn.k": col(), "attn.v": col(), "attn.o": row(), "mlp.w1": col(), "mlp.w2": row()}


def build(seed: int = 0, n_blocks: int = 2, device=None) -> TinyLM:
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        return TinyLM(n_blocks)


def shard(i: Impl, model: nn.Module, dp_mesh, tp_mesh=None, **kw) -> nn.Module:
    """TP (blocks only) when ``tp_mesh``, then fully_shard every block and the root on ``dp_mesh``."""
    for b in model.blocks:
        if tp_mesh is not None:
            i.parallelize_module(b, tp_mesh, tp_plan(i))
        i.fully_shard(b, mesh=dp_mesh, **kw)
    i.fully_shard(model, mesh=dp_mesh, **kw)
    return model


# -- data, steps, comparisons ----------------------------------------------------------------------
def batches(steps: int, seed: int = 1, batch: int = BATCH) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g) for _ in range(steps)]


def loss_of(model, tokens) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def dp_slice(tokens: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    per = tokens.shape[0] // dp_size
    return tokens[dp_rank * per:(dp_rank + 1) * per]


def train(model, optim, data, dp_rank: int = 0, dp_size: int = 1) -> list[float]:
    """One step per batch on this dp rank's slice; returns the losses averaged over dp ranks
    (each rank's slice has the same size, so the mean of means is the global mean)."""
    out = []
    for tokens in data:
        loss = loss_of(model, dp_slice(tokens, dp_rank, dp_size))
        loss.backward()
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        if dp_size > 1:
            dist.all_reduce(mean)  # over all ranks: tp ranks of one dp rank hold equal losses
            mean /= dist.get_world_size()
        out.append(mean.item())
    return out


def full_params(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """``{fqn: full tensor}`` of the parameters (or their gradients), collective for DTensors;
    the ``_orig_mod.`` of compiled submodules is left out of the names."""
    out = {}
    for n, p in model.named_parameters():
        t = p.grad if grads else p
        out[n.replace("_orig_mod.", "")] = t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def assert_close(got: dict, want: dict, tol: float, where: str) -> None:
    assert got.keys() == want.keys(), f"{where}: names differ: {sorted(set(got) ^ set(want))}"
    bad = {k: rel_err(got[k], want[k]) for k in want}
    bad = {k: e for k, e in bad.items() if not e <= tol}
    assert not bad, f"{where}: relative error above {tol}: {bad}"


def assert_losses(got: list[float], want: list[float], tol: float, where: str) -> None:
    assert rel_errs(got, want) <= tol, f"{where}: losses {got} vs reference {want}"


def reference(data, seed: int = 0, lr: float = 1e-2, optim=torch.optim.AdamW) -> tuple[nn.Module, list[float]]:
    """The single-process run every scenario is checked against: same seed, whole batches."""
    model = build(seed)
    opt = optim(model.parameters(), lr=lr)
    return model, train(model, opt, data)


def flat_state(state: Any, key: str = "") -> dict[str, torch.Tensor]:
    """Flat ``{path: full tensor}`` of a state's tensors (collective for DTensors)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, torch.Tensor):
        out[key] = state.full_tensor() if isinstance(state, DTensor) else state.detach().clone()
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(flat_state(v, f"{key}/{k}" if key else str(k)))
    elif isinstance(state, (list, tuple)):
        for n, v in enumerate(state):
            out.update(flat_state(v, f"{key}/{n}"))
    return out


def assert_equal_states(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), f"{where}: keys differ: {sorted(set(got) ^ set(want))}"
    bad = [k for k in want if not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))]
    assert not bad, f"{where}: not bit-exact: {bad}"

