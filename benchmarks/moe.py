"""Expert parallelism against the same MoE trained with FSDP only (every expert gathered).

    torchrun --nproc-per-node 4 benchmarks/moe.py                  # gloo ranks on CPU
    torchrun --nproc-per-node 4 benchmarks/moe.py --ep 2 4 --ep-tp 2x2 --reps 5 --dim 128 --experts 8

The ranks build the MoE Llama of ``examples/moe.py`` (every block's feed-forward an ``MoE``,
top-k softmax routing, dropless) once per layout from one seed and train it with AdamW on the
same batches (``examples/data.py``), side by side in one process group:

    layout    experts                                            dense weights
    fsdp      in each block's fully_shard unit (gathered)        fully_shard over all W ranks
    ep N      ExpertParallel over ep, fully_shard_experts        fully_shard over all W ranks
              over W / N ranks
    ep N x    ExpertTensorParallel: N-way ep, each expert's      attention, embedding, head
    tp M      w1/w3 column- and w2 row-split over tp, fully_     split over tp; fully_shard
              shard_experts over W / (N M) ranks                 over the W / M dp ranks
                                                                 (each dp rank's batch on
                                                                 its M tp ranks)

Reported per layout: peak tensor bytes per rank over training steps (`benchmarks.tracker`),
the median step time (repetitions alternate between the layouts, so all see the same machine
load) and its ratio to fsdp, the bytes one rank sends in all-to-alls per MoE layer in one
forward + backward (counted exactly: the rows it sends to *other* ranks, from the split sizes)
against the theory, the token balance (max / mean over ranks of the rows the ranks' experts
computed) and the router's load-balancing loss and tokens-per-expert histogram of layer 0.

Theory, per MoE layer and rank: ``T`` tokens of the rank, ``k`` experts each, width ``D``,
fp32. With uniform routing a row goes to another rank with probability ``(ep - 1) / ep``;
dispatch and combine each move the ``T k`` rows once per pass, so forward sends
``2 T k D (ep - 1) / ep`` elements and backward the same again: ``4 T k D (ep - 1) / ep x 4``
bytes per forward + backward. The routing of a trained or random router is not exactly
uniform, so measured / theory is near, not at, 1. Under ep x tp ``T`` is the tokens of the
rank's dp group (every tp rank routes them); the tp all-reduces of the expert rows (forward
and backward, [Note: expert tensor parallelism]) are counted in their own column.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples`, `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from benchmarks.tracker import AllocationTracker  # noqa: E402
from examples.data import global_batch, inputs_and_targets, local_slice  # noqa: E402
from examples.model import LlamaConfig  # noqa: E402
from examples.moe import moe_llama, shard_moe_llama  # noqa: E402
from shardwise.composable import loss_parallel  # noqa: E402
from shardwise.mesh import init_distributed, init_mesh  # noqa: E402

MB = 2**20


class AllToAllBytes:
    """Counts the bytes this rank sends to other ranks through ``dist.all_to_all_single`` while
    active (the library looks the function up at each call): ``total - own split``."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.rows_bytes = 0  # token rows (2-D tensors)
        self.other_bytes = 0  # the count exchanges
        self.calls = 0

    def __enter__(self):
        self.real = dist.all_to_all_single

        def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            n = dist.get_world_size(group)
            me = dist.get_rank(group)
            per_row = input[0].numel() * input.element_size() if input.dim() and input.shape[0] else 0
            if input_split_sizes is None:
                sent = (n - 1) * input.numel() * input.element_size() // n
            else:
                sent = (sum(input_split_sizes) - input_split_sizes[me]) * per_row
            if input.dim() > 1:
                self.rows_bytes += sent
            else:
                self.other_bytes += sent
            self.calls += 1
            return self.real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        self.real_ar = dist.all_reduce
        self.tp_bytes = 0  # all-reduces of token rows (2-D tensors): the experts' tp sums

        def counting_ar(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if tensor.dim() == 2 and tensor.shape[1] == self.dim:  # ring all-reduce: 2 (n - 1) / n of the tensor leaves each rank
                n = dist.get_world_size(group)
                self.tp_bytes += 2 * (n - 1) * tensor.numel() * tensor.element_size() // n
            return self.real_ar(tensor, op=op, group=group, async_op=async_op)

        dist.all_to_all_single = counting
        dist.all_reduce = counting_ar
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self.real
        dist.all_reduce = self.real_ar


def _step(model, optim, batch, tracker=None) -> float:
    inputs, targets = batch
    logits = model(inputs)
    if isinstance(logits, DTensor):  # class-sharded logits under tensor parallelism
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    else:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss = model.extra_loss(loss)
    optim.zero_grad(set_to_none=True)
    loss.backward()
    optim.step()
    return (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()


def _layer_rows(model) -> int:
    """Rows this rank's experts computed in the last forward, summed over the layers."""
    total = 0
    for block in model.layers:
        stats = getattr(block.feed_forward.experts, "dispatch_stats", None)
        total += sum(stats.per_local_expert) if stats is not None else int(block.feed_forward.stats.tokens_per_expert.sum())
    return total


def run(args) -> None:
    rank, world = init_distributed()
    torch.set_num_threads(args.threads)
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=4,
                      max_seq_len=max(args.seq_len, 128))
    layouts = [(1, 1)] + [(ep, 1) for ep in args.ep] + [tuple(int(v) for v in s.split("x")) for s in args.ep_tp]
    n_steps = 4 + args.reps * args.steps
    models, optims, batches, tokens = {}, {}, {}, {}
    for ep, tp in layouts:
        mesh = init_mesh(device_type="cpu", ep=ep, tp=tp)
        models[ep, tp] = shard_moe_llama(moe_llama(cfg, args.experts, args.top_k, torch.Generator().manual_seed(0)),
                                         mesh, ep)
        optims[ep, tp] = torch.optim.AdamW(models[ep, tp].parameters(), lr=1e-3)
        dp_rank = mesh["dp_shard"].get_local_rank()  # the tp ranks of a dp rank train on its batch
        batches[ep, tp] = [inputs_and_targets(local_slice(global_batch(i, args.batch_size, args.seq_len,
                                                                       cfg.vocab_size, 0), dp_rank, world // tp))
                           for i in range(n_steps)]
        tokens[ep, tp] = batches[ep, tp][0][0].numel()
    out = {}
    for ep, model in models.items():
        for b in batches[ep][:2]:
            _step(model, optims[ep], b)
        tracker = AllocationTracker()
        state = [t for s in optims[ep].state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        tracker.track(list(model.parameters()) + list(model.buffers()), "params")
        tracker.track(state, "optimizer")
        counter = AllToAllBytes(args.dim)
        with tracker, counter:
            _step(model, optims[ep], batches[ep][2])
        rows = torch.tensor([_layer_rows(model)], dtype=torch.float64)
        gathered = [torch.zeros_like(rows) for _ in range(world)]
        dist.all_gather(gathered, rows)
        per_rank = [float(g.item()) for g in gathered]
        hist = models[ep].layers[0].feed_forward.stats.tokens_per_expert.clone()
        dist.all_reduce(hist)
        hist //= ep[1]  # the tp ranks of a dp rank routed the same tokens
        out[ep] = dict(peak=tracker.peak, a2a=counter.rows_bytes / args.layers, counts=counter.other_bytes,
                       tp_bytes=counter.tp_bytes / args.layers,
                       balance=max(per_rank) / (sum(per_rank) / world), hist=hist.tolist(),
                       aux=float(models[ep].layers[0].feed_forward.aux_loss.detach()), times=[])
    for rep in range(args.reps):
        for ep in layouts if rep % 2 == 0 else layouts[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            for k in range(args.steps):
                _step(models[ep], optims[ep], batches[ep][4 + rep * args.steps + k])
            dist.barrier()
            out[ep]["times"].append((time.perf_counter() - t0) / args.steps)
    peaks = torch.tensor([[out[ep]["peak"] for ep in layouts]], dtype=torch.float64)
    all_peaks = [torch.zeros_like(peaks) for _ in range(world)]
    dist.all_gather(all_peaks, peaks)
    if rank == 0:
        base_t = statistics.median(out[1, 1]["times"])
        base_peak = max(float(p[0, 0]) for p in all_peaks)
        print(f"MoE Llama dim {args.dim}, {args.layers} layers, {args.experts} experts top-{args.top_k}, "
              f"{world} ranks, {args.batch_size * args.seq_len} tokens per step, fp32, gloo CPU, "
              f"{args.reps} x {args.steps} steps")
        print("| layout | tokens per rank | peak MiB per rank (max) | / fsdp | step ms (median) | / fsdp | all-to-all "
              "MiB per layer fwd+bwd (rank 0) | theory MiB | measured / theory | tp all-reduce MiB per layer | "
              "token balance max/mean | aux loss layer 0 |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for i, (ep, tp) in enumerate(layouts):
            o = out[ep, tp]
            peak = max(float(p[0, i]) for p in all_peaks)
            t = statistics.median(o["times"])
            th = 4 * tokens[ep, tp] * args.top_k * args.dim * (ep - 1) / ep * 4
            name = "fsdp (ep 1)" if ep == tp == 1 else f"ep {ep} x " + (f"tp {tp} x " if tp > 1 else "") + \
                f"fsdp {world // ep // tp}"
            ratio = f"{o['a2a'] / th:.3f}" if th else "-"
            print(f"| {name} | {tokens[ep, tp]} | {peak / MB:.2f} | {peak / base_peak:.2f} | {t * 1e3:.0f} | "
                  f"{t / base_t:.2f} | {o['a2a'] / MB:.3f} | {th / MB:.3f} | {ratio} | {o['tp_bytes'] / MB:.3f} | "
                  f"{o['balance']:.2f} | {o['aux']:.4f} |")
        print(f"tokens per expert, layer 0, all ranks (one step): {out[layouts[-1]]['hist']}")
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4], help="expert-parallel degrees to compare with fsdp")
    p.add_argument("--ep-tp", nargs="*", default=["2x2"], help="EPxTP layouts (experts split over both) to compare")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (rows), split over the ranks")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=2, help="steps per timed repetition")
    p.add_argument("--threads", type=int, default=1)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
