"""``torch.compile(model, fullgraph=True)`` on a model sharded per block and at the root: the
traced unit ([Note: the traced unit] in ``composable/_fsdp/_traced.py``).

One rank body per configuration compiles once (``aot_eager`` through a backend that keeps the
forward and backward graphs AOTAutograd partitioned) and checks, against eager shardwise on the
same ranks and data: zero graph breaks (``torch._dynamo.explain``), losses and parameters over
three AdamW steps within 1e-6, and, from the graphs, the collectives (count and bytes) and what
the forward saves for the backward."""

from __future__ import annotations

import copy

import torch

from shardwise.composable import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from tests._dist import run_on_workers
from tests._models import Net, batches, loss_fn, make_mesh

TOL = 1e-6  # fp32, relative: the graph computes the eager unit's ops (sum of the same gradients, same division)
AG = "all_gather_into_tensor"
RS = "reduce_scatter_tensor"
AR = "all_reduce"


def _capturing_backend(graphs: dict):
    """aot_eager (the same partitioner) that keeps each forward / backward graph."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler
    return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"),
                        partition_fn=min_cut_rematerialization_partition, keep_inference_input_mutations=True)


def _collectives(gm) -> list[tuple[str, int]]:
    """(collective, bytes moved per rank: output of an all-gather, input of a reduce-scatter)."""
    out = []
    for n in gm.graph.nodes:
        name = getattr(n.target, "__name__", "")
        if n.op == "call_function" and any(name.startswith(c) for c in (AG, RS, AR)):
            t = n.meta["val"] if name.startswith(AG) else n.args[0].meta["val"]
            out.append((name.split(".")[0], t.numel() * t.element_size()))
    return out


def _saved_bytes(gm) -> int:
    """Bytes of the forward graph's outputs after the first (the model output, or the root's
    gathered parameters for its pre-hook's graph, counted alike with either setting): what it saves."""
    (outs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    return sum(o.meta["val"].numel() * o.meta["val"].element_size() for o in outs[1:]
               if hasattr(o, "meta") and isinstance(o.meta.get("val"), torch.Tensor))


def _saved_shapes(gm) -> list:
    (outs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    return [(tuple(o.meta["val"].shape), str(o.meta["val"].dtype)) for o in outs[1:]
            if hasattr(o, "meta") and isinstance(o.meta.get("val"), torch.Tensor)]


def _build(base, world, mesh_shape, **kw):
    model = copy.deepcopy(base)
    mesh = make_mesh(mesh_shape)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
    root_kw = {k: v for k, v in kw.items() if k != "reshard_after_forward"}
    fully_shard(model, mesh=mesh, **root_kw)
    return model


def _train(model, run, rank, dp, steps=3, batch=8):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    per = batch // dp
    for tokens, target in batches(steps, batch):
        sl = slice(rank * per, (rank + 1) * per)
        loss = loss_fn(run(tokens[sl]), target[sl])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.full_tensor() for n, p in model.named_parameters()}


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


class CheckpointedNet(Net):
    """`Net` with each block under activation checkpointing (``checkpoint(block, x)``)."""

    def forward(self, tokens):
        from torch.utils.checkpoint import checkpoint

        x = self.emb(tokens)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return self.head(x) * self.scale.sum()


def _compiled_vs_eager(rank, world, mesh_shape=None, backend="capture", explain=True, net=Net, **kw):
    """Eager shardwise and the compiled model from the same start; what the test checks."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    mesh_shape = mesh_shape or (world,)
    base = net(n_blocks=2)
    eager = _build(base, world, mesh_shape, **kw)
    e_losses, e_params = _train(eager, eager, rank, world)
    model = _build(base, world, mesh_shape, **kw)
    out = {}
    if explain:
        ex = torch._dynamo.explain(lambda t: model(t))(torch.zeros(4, 5, dtype=torch.long))  # the call, hooks and all
        out["breaks"], out["graphs"] = ex.graph_break_count, ex.graph_count
        torch._dynamo.reset()
    graphs: dict = {"fw": [], "bw": []}
    be = _capturing_backend(graphs) if backend == "capture" else backend
    c_losses, c_params = _train(model, torch.compile(model, fullgraph=True, backend=be), rank, world)
    out["loss_err"] = max(abs(a - b) / abs(b) for a, b in zip(c_losses, e_losses))
    out["param_err"] = max(_rel(c_params[n], e_params[n]) for n in e_params)
    out["grad_types"] = sorted({type(p).__name__ for p in model.parameters()})
    if graphs["fw"]:
        out["fw"] = sorted(c for gm in graphs["fw"] for c in _collectives(gm))
        out["bw"] = sorted(c for gm in graphs["bw"] for c in _collectives(gm))
        out["saved"] = sum(_saved_bytes(gm) for gm in graphs["fw"])
        out["saved_shapes"] = [_saved_shapes(gm) for gm in graphs["fw"]]
        out["n_graphs"] = (len(graphs["fw"]), len(graphs["bw"]))
    units = [b for b in model.blocks] + [model]
    groups = [fully_shard.state(u).group for u in units]  # W: the shard axis
    out["ag_bytes"] = [g.world * g.ag_bytes for g in groups]
    out["rs_bytes"] = [g.world * sum(p.layout.padded_numel for p in g.params) * 4 for g in groups]
    return out


def _fsdp(rank, world):
    """FSDP on 2 ranks: default (blocks reshard, root keeps) and reshard_after_forward=False."""
    return {raf: _compiled_vs_eager(rank, world, explain=raf is None, **({} if raf is None else
                                                                           {"reshard_after_forward": raf}))
            for raf in (None, False)}


def test_fsdp_whole_model_fullgraph_trains_as_eager_with_the_eager_collectives():
    for rank, res in enumerate(run_on_workers(_fsdp, 2, timeout=900)):
        d, keep = res[None], res[False]
        assert (d["breaks"], d["graphs"]) == (0, 1), d
        for r in (d, keep):
            assert r["loss_err"] <= TOL and r["param_err"] <= TOL, (rank, r)
            # torch.compile(module) traces the root's hooks and its forward as frames of their own: the
            # root's gather, then the rest (the blocks' hooks inlined); no recompilation over three steps
            assert r["n_graphs"] == (2, 2), r
        # forward: one all-gather per unit (2 blocks + root), of the unit's flat buffer
        assert d["fw"] == sorted(("all_gather_into_tensor", b) for b in d["ag_bytes"]), d
        # backward: the two resharded blocks gathered again (recomputed, not saved), the root
        # not; one reduce-scatter per unit, of W * the padded shard elements (fp32)
        ags = sorted(b for c, b in d["bw"] if c == AG)
        rss = sorted(b for c, b in d["bw"] if c == RS)
        assert ags == sorted(d["ag_bytes"][:2]) and rss == sorted(d["rs_bytes"]), d
        assert sorted(b for c, b in keep["bw"] if c == RS) == rss and not [c for c, _ in keep["bw"] if c == AG], keep
        # what the forward keeps for the backward: with reshard_after_forward=True each block's flat
        # shard (1/W of its gathered bytes) and none of its gathered weights (FULL_SHARD); with
        # False the gathered weights (ZeRO-2), as the eager unit keeps them
        weights = {((6, 7), "torch.float32"), ((7, 6), "torch.float32")}
        saved, kept = [t for g in d["saved_shapes"] for t in g], [t for g in keep["saved_shapes"] for t in g]
        assert not weights & set(saved) and saved.count(((d["ag_bytes"][0] // 2,), "torch.uint8")) == 2, saved
        assert sum(kept.count(w) for w in weights) == 4 and d["saved"] < keep["saved"], kept


def _hsdp_mixed_precision(rank, world):
    """HSDP on a (2, 2) mesh with bf16 parameters and fp32 reduction."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return _compiled_vs_eager(rank, world, mesh_shape=(2, 2), explain=False, mp_policy=mp)


def test_hsdp_with_mixed_precision_trains_as_eager():
    for rank, r in enumerate(run_on_workers(_hsdp_mixed_precision, 4, timeout=900)):
        # the graph runs the eager unit's casts and sums in the same order: equal to the bit
        assert r["loss_err"] == 0.0 and r["param_err"] == 0.0, (rank, r)
        # per unit: a bf16 all-gather over the shard axis (2 ranks), an fp32 reduce-scatter
        # there and an fp32 all-reduce of the reduced shard over the replicas
        assert r["fw"] == sorted(("all_gather_into_tensor", b) for b in r["ag_bytes"]), r
        assert sorted(b for c, b in r["bw"] if c == RS) == sorted(r["rs_bytes"]), r
        assert sorted(b for c, b in r["bw"] if c == AR) == sorted(b // 2 for b in r["rs_bytes"]), r


def _checkpointed(rank, world):
    import torch._dynamo

    # the hooks' parameter swaps are side effects inside the user's checkpoint; dynamo refuses
    # them ("HOP: Unsafe side effect") unless told not to replay them in the recomputation
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        return _compiled_vs_eager(rank, world, explain=False, net=CheckpointedNet)


def test_activation_checkpointed_blocks_train_as_eager():
    """``checkpoint(block, x)`` around each unit: its gather (itself recomputed) runs inside the
    user's checkpointed region; the backward re-gathers each block once."""
    for rank, r in enumerate(run_on_workers(_checkpointed, 2, timeout=900)):
        assert r["loss_err"] <= TOL and r["param_err"] <= TOL, (rank, r)
        assert sorted(b for c, b in r["bw"] if c == AG) == sorted(r["ag_bytes"][:2]), r
        assert sorted(b for c, b in r["bw"] if c == RS) == sorted(r["rs_bytes"]), r


def _inductor(rank, world):
    return _compiled_vs_eager(rank, world, backend="inductor", explain=False)


def test_inductor_trains_as_eager():
    """The one inductor case (CPU C++ code generation: slow to compile)."""
    for rank, r in enumerate(run_on_workers(_inductor, 2, timeout=1500)):
        assert r["loss_err"] <= TOL and r["param_err"] <= TOL, (rank, r)


def _refused(rank, world, case):
    import torch._dynamo
    from tests.compat._lowp import Bf16GatherWeight

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, mesh, kw = Net(n_blocks=2), make_mesh((world,)), {}
    if case == "offload":
        kw["offload_policy"] = CPUOffloadPolicy()
    if case == "extension":
        model.blocks[1].down.weight = torch.nn.Parameter(Bf16GatherWeight(model.blocks[1].down.weight.detach()))
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh)
    if case == "no_sync":
        model.set_requires_gradient_sync(False)
    try:
        torch.compile(model, fullgraph=True, backend="aot_eager")(torch.zeros(4, 5, dtype=torch.long))
    except Exception as e:  # dynamo's Unsupported, carrying the refusal raised while tracing
        return str(e)
    return "compiled"


def test_what_cannot_be_traced_is_refused_naming_it():
    """Refused while tracing, with the unit and the parameter or setting named: no eager
    fallback inside a compiled step."""
    want = {"offload": "fully_shard(Block): CPU offload (offload_policy=CPUOffloadPolicy)",
            "extension": "fully_shard(Block): 'down.weight' is a tensor subclass with fsdp_pre_all_gather",
            "no_sync": "fully_shard(Net): set_requires_gradient_sync(False)"}
    for case, line in want.items():
        for msg in run_on_workers(_refused, 2, case, timeout=300):
            assert f"torch.compile of {line}" in msg, (case, msg[:2000])


def _collectives_eagerly(rank, world):
    from shardwise.composable._compat import traced_collective

    g = torch.distributed.group.WORLD
    t = torch.arange(4.0) + 10 * rank
    return (traced_collective("all_gather", t, g).tolist(), traced_collective("reduce_scatter", t, g).tolist(),
            traced_collective("all_reduce", t, g).tolist())


def test_traced_collective_outside_a_trace():
    """``_compat.traced_collective`` (torch's functional collectives): rank-major all-gather on
    dim 0, summing reduce-scatter on dim 0, summing all-reduce; finished tensors in eager."""
    out = run_on_workers(_collectives_eagerly, 2, timeout=120)
    for rank, (ag, rs, ar) in enumerate(out):
        assert ag == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0], ag
        assert rs == [[10.0, 12.0], [14.0, 16.0]][rank] and ar == [10.0, 12.0, 14.0, 16.0], (rs, ar)


def _hf_llama(rank, world):
    """A tiny Hugging Face Llama, each decoder layer a unit and the model the root."""
    import torch._dynamo
    import transformers as tf

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32, vocab_size=48)
    base = tf.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 48, (4, 8), generator=g)
    runs = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        mesh = make_mesh((world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        run = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(2):
            mine = ids[rank * 2: rank * 2 + 2]
            loss = run(input_ids=mine, labels=mine).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, {n: p.full_tensor() for n, p in model.named_parameters()}))
    (el, ep), (cl, cp) = runs
    return max(abs(a - b) / abs(b) for a, b in zip(cl, el)), max(_rel(cp[n], ep[n]) for n in ep)


def test_hugging_face_llama_trains_as_eager():
    for rank, (loss_err, param_err) in enumerate(run_on_workers(_hf_llama, 2, timeout=900)):
        assert loss_err <= TOL and param_err <= TOL, (rank, loss_err, param_err)
