"""GPU training step: shardwise's ``fully_shard`` against torch's FSDP2, time and peak memory.

    python benchmarks/gpu_step.py                                # one GPU: a one-rank NCCL group
    torchrun --nproc-per-node 8 benchmarks/gpu_step.py           # several GPUs: FSDP over all
    python benchmarks/gpu_step.py --device cpu --dim 64 --layers 2 --seq-len 32 --steps 2   # smoke
    python benchmarks/gpu_step.py --float8                       # torchao float8 (docs/low_precision.md)

Without CUDA (and without ``--device cpu``) it prints why and exits with status 0.

The Llama of ``examples/model.py`` is built on the device from one seed for each
implementation, one unit per block then the root, with the same mesh, ``reshard_after_forward``
and mixed precision (``--mp bf16``: bf16 parameters in compute, fp32 gradient reduction, fp32
master weights and AdamW state; the default on CUDA). Two phases:

1. memory: one implementation at a time (the other's model does not exist), two warm-up steps,
   then ``torch.cuda.reset_peak_memory_stats()`` and ``--mem-steps`` steps;
   ``torch.cuda.max_memory_allocated()`` is the peak, ``memory_allocated()`` before them the
   states kept between steps.
2. time: both models alive, ``--reps`` repetitions of ``--steps`` steps alternating A B, B A, ...;
   a repetition is timed with CUDA events around its steps after a barrier (``perf_counter`` on
   CPU). Reported: medians and the median of the per-repetition ratios shardwise / FSDP2.

With a one-rank group both implementations shard over one rank, which measures their per-step
overhead around the same compute (copies, hooks, casts) rather than communication.

``--float8`` (needs torchao): both copies first convert the blocks' linears with torchao's
``convert_to_float8_training`` (tensorwise scaling, ``enable_fsdp_float8_all_gather=True``) and
end every step with ``precompute_float8_dynamic_scale_for_fsdp``: float8 matmuls (``torch._scaled_mm``,
sm_89 or newer) and float8 all-gathers through FSDP2's all-gather extension. On a CPU the matmuls are
emulated and the times say nothing about float8. The bytes all-gathered in one step are counted
(``benchmarks/_comm_count.py``) for both implementations and printed with the float8 theory.

Before the two phases, a correctness check that only a GPU can make: with ``CPUOffloadPolicy``,
after a step's backward every sharded parameter and gradient must be on the CPU (the optimizer
steps there), for both implementations; the model's output on the device. On a CPU-only host
"offloaded" and "on the device" are the same place, so the check runs its code path in the smoke
mode but proves nothing there. A failure prints ``offload check FAILED`` and the exit status is 1.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from examples.model import Llama, LlamaConfig  # noqa: E402

GiB = 2**30
IMPLS = ("shardwise", "torch FSDP2")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--mp", choices=("bf16", "none"), default=None, help="default: bf16 on cuda, none on cpu")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-per-rank", type=int, default=4)
    p.add_argument("--reshard-after-forward", choices=("true", "false"), default="true")
    p.add_argument("--reps", type=int, default=6, help="interleaved repetitions per implementation")
    p.add_argument("--steps", type=int, default=5, help="timed steps per repetition")
    p.add_argument("--mem-steps", type=int, default=2)
    p.add_argument("--float8", action="store_true", help="torchao float8 training with the float8 all-gather")
    return p.parse_args(argv)


def is_float8_linear(module: torch.nn.Module, fqn: str) -> bool:
    """The linears ``--float8`` converts: the blocks' (not the output head), dims multiples of 16."""
    return (fqn.startswith("layers.") and isinstance(module, torch.nn.Linear)
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def build(impl: str, cfg: LlamaConfig, args, mesh, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.device(device):
        model = Llama(cfg, generator=gen)
    if args.float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        model = convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                                           module_filter_fn=is_float8_linear)
    bf16 = args.mp == "bf16"
    if impl == "shardwise":
        from shardwise.composable import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    raf = args.reshard_after_forward == "true"
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=raf, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=None if raf else False, mp_policy=mp)
    model.float8_precompute = args.float8
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def offload_check(cfg: LlamaConfig, device: torch.device, mesh, tokens: torch.Tensor) -> list[str]:
    """Problems found with CPU offload after one step's backward, per implementation (none: [])."""
    problems = []
    for impl in IMPLS:
        if impl == "shardwise":
            from shardwise.composable import CPUOffloadPolicy, fully_shard
        else:
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
        policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        with torch.device(device):
            model = Llama(cfg, generator=torch.Generator(device=device).manual_seed(0))
        for block in model.layers:
            fully_shard(block, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        logits = model(tokens[:, :-1])
        if logits.device != tokens.device:
            problems.append(f"{impl}: output on {logits.device}, input on {tokens.device}")
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            if local.device.type != "cpu":
                problems.append(f"{impl}: parameter {name} on {local.device}, offload keeps it on cpu")
            if grad is None or grad.device.type != "cpu":
                problems.append(f"{impl}: gradient of {name} on {None if grad is None else grad.device}, "
                                "offload moves it to cpu for the optimizer")
        del model, logits
        gc.collect()
    return problems


def step(model, optim, tokens) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    if getattr(model, "float8_precompute", False):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)  # one all-reduce for all the weights' scales
    return loss.detach()


def float8_bytes(cfg: LlamaConfig, args, mesh, device, tokens) -> list[str]:
    """One counted step of each implementation under ``--float8``: bytes all-gathered against the
    theory (every block twice, forward and backward, the root once; float8 weights 1 byte an
    element, the rest in the all-gather dtype: bf16 under ``--mp bf16``). One GPU moves nothing: the
    bytes need ``torchrun --nproc-per-node N``; a one-GPU run measures the float8 step's time only."""
    from benchmarks._comm_count import CommCounter

    with torch.device("meta"):
        ref = Llama(cfg)
    low = {id(m.weight) for n, m in ref.named_modules() if is_float8_linear(m, n)}
    other = 2 if args.mp == "bf16" else 4
    W = mesh.size()

    def unit(params) -> int:  # padded to a multiple of W rows, as every rank gathers equal pieces
        return sum(-(-p.shape[0] // W) * W * (p.numel() // p.shape[0]) * (1 if id(p) in low else other) for p in params)

    blocks = [unit(b.parameters()) for b in ref.layers]
    in_blocks = {id(p) for b in ref.layers for p in b.parameters()}
    # one rank gathers nothing: its shard is the whole parameter ([Note: a shard of one rank])
    theory = 0 if W == 1 else 2 * sum(blocks) + unit(p for p in ref.parameters() if id(p) not in in_blocks)
    lines = []
    for impl in IMPLS:
        model, optim = build(impl, cfg, args, mesh, device)
        step(model, optim, tokens)  # the first step casts without precomputed scales
        counter = CommCounter()
        with counter:
            step(model, optim, tokens)
        got = sum(c.size_bytes for c in counter.calls if c.kind == "all_gather")
        lines.append(f"{impl}: {got:,} B all-gathered in one float8 step (theory {theory:,} B); collectives "
                     + ", ".join(f"{k} {n}" for k, (n, _) in counter.by_kind().items()))
        del model, optim
        gc.collect()
    return lines


class Clock:
    """Wall time of a block of steps: CUDA events on a GPU, perf_counter on CPU (after a barrier)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        dist.barrier()
        if self.cuda:
            self._a, self._b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._a.record()
        else:
            self._t = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self._b.record()
            torch.cuda.synchronize()
            return self._a.elapsed_time(self._b) / 1e3
        return time.perf_counter() - self._t


def memory_phase(cfg, args, mesh, device, batches) -> dict:
    out = {}
    for impl in IMPLS:
        model, optim = build(impl, cfg, args, mesh, device)
        for b in batches[:2]:
            step(model, optim, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            states = torch.cuda.memory_allocated()
        for i in range(args.mem_steps):
            step(model, optim, batches[i % len(batches)])
        if device.type == "cuda":
            torch.cuda.synchronize()
            out[impl] = (torch.cuda.max_memory_allocated(), states)
        del model, optim
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def time_phase(cfg, args, mesh, device, batches) -> tuple[dict, float]:
    built = {impl: build(impl, cfg, args, mesh, device) for impl in IMPLS}
    losses = {impl: [step(*built[impl], b).item() for b in batches[:2]] for impl in IMPLS}  # warm-up
    clock, times = Clock(device), {impl: [] for impl in IMPLS}
    for rep in range(args.reps):
        for impl in IMPLS if rep % 2 == 0 else IMPLS[::-1]:
            clock.start()
            for k in range(args.steps):
                last = step(*built[impl], batches[(rep * args.steps + k) % len(batches)])
            times[impl].append(clock.stop() / args.steps)
            losses[impl].append(last.item())
    diff = max(abs(a - b) / abs(b) for a, b in zip(*losses.values()))
    return times, diff


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_step.py: CUDA is not available on this machine, nothing to measure. Run it on a GPU host, "
              "or use --device cpu for a smoke run of the same code path.", file=sys.stderr)
        return 0
    args.mp = args.mp or ("bf16" if args.device == "cuda" else "none")
    from shardwise.mesh import init_distributed, init_mesh

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = init_distributed(backend="nccl" if args.device == "cuda" else "gloo")
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    mesh = init_mesh(dp_shard=-1, device_type=args.device)["dp_shard"]
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      max_seq_len=max(args.seq_len, LlamaConfig.max_seq_len))
    g = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, args.vocab, (args.batch_per_rank, args.seq_len + 1), generator=g).to(device)
               for _ in range(4)]
    say = print if rank == 0 else (lambda *a, **k: None)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    with torch.device("meta"):
        n = sum(p.numel() for p in Llama(cfg).parameters())
    say(f"{name} x {world}; torch {torch.__version__}; mp={args.mp}; float8={args.float8}; reshard_after_forward="
        f"{args.reshard_after_forward}\nmodel: {cfg}\n{n / 1e6:,.1f} M params; {args.batch_per_rank} x "
        f"{args.seq_len} tokens per rank")
    small = LlamaConfig(vocab_size=args.vocab, dim=64, n_layers=2, n_heads=4, max_seq_len=cfg.max_seq_len)
    problems = offload_check(small, device, mesh, batches[0][:1])  # where tensors live, not speed: small
    say(f"offload check ({'meaningful' if device.type == 'cuda' else 'code path only, cpu host'}): "
        + ("ok, parameters and gradients on cpu after backward for " + " and ".join(IMPLS) if not problems
           else "FAILED\n  " + "\n  ".join(problems[:20])))
    if args.float8:
        for line in float8_bytes(cfg, args, mesh, device, batches[0]):
            say(line)
    mem = memory_phase(cfg, args, mesh, device, batches)
    times, diff = time_phase(cfg, args, mesh, device, batches)
    ratios = [a / b for a, b in zip(times[IMPLS[0]], times[IMPLS[1]])]
    say("| implementation | median step ms | peak allocated GiB | allocated between steps GiB |")
    say("| --- | ---: | ---: | ---: |")
    for impl in IMPLS:
        peak, states = mem.get(impl, (None, None))
        cells = ("n/a (cpu)", "n/a (cpu)") if peak is None else (f"{peak / GiB:.2f}", f"{states / GiB:.2f}")
        say(f"| {impl} | {statistics.median(times[impl]) * 1e3:.1f} | {cells[0]} | {cells[1]} |")
    say(f"shardwise / FSDP2 step time: median {statistics.median(ratios):.3f} [{min(ratios):.2f}, {max(ratios):.2f}] "
        f"over {args.reps} interleaved repetitions of {args.steps} steps")
    if IMPLS[0] in mem:
        say(f"shardwise / FSDP2 peak memory: {mem[IMPLS[0]][0] / mem[IMPLS[1]][0]:.3f}")
    say(f"largest relative loss difference between the two at equal steps: {diff:.1e}")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
