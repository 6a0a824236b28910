"""``fully_shard`` set-up on a simulated world of 512 ranks: init time and per-rank sizes.

    python benchmarks/scale.py                       # GPT-3-sized Llama (175 B), world 512

No devices and no real communication: each simulated rank is one process that joins torch's
fake process group (``torch.testing._internal.distributed.fake_pg.FakeStore``, backend
"fake", which answers every collective at once without moving data) as rank ``r`` of
``--world``, builds the Llama of ``examples/model.py`` on the meta device, builds the device
mesh and applies ``fully_shard`` to every block and then the root. Reported per (layout, rank):
seconds for the mesh and for all ``fully_shard`` calls, the parameter bytes this rank holds
(the local shards of the DTensors, i.e. what it would allocate once materialised) against
``plan_memory``'s estimate for the same layout, and the rank's share of the full model.

The FSDP paper (Zhao et al., "PyTorch FSDP", VLDB 2023) trains GPT-175B on up to 512 A100s;
``--dim 12288 --layers 96 --heads 96 --vocab 50304`` (the default) is that size with a SwiGLU
feed-forward. Rank 0 holds a full chunk of every parameter; the last rank the remainder.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples`, `benchmarks`, `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from examples.model import Llama, LlamaConfig  # noqa: E402

GiB = 2**30


def simulate(_rank: int, _world: int, rank: int, fake_world: int, mesh_shape: tuple[int, ...], cfg: LlamaConfig) -> dict:
    """One simulated rank (run in its own process): time the mesh and fully_shard, sum local bytes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardwise.composable import fully_shard

    t0 = time.perf_counter()
    dist.init_process_group("fake", rank=rank, world_size=fake_world, store=FakeStore())
    mesh = init_device_mesh("cpu", mesh_shape)
    t1 = time.perf_counter()
    with torch.device("meta"):
        model = Llama(cfg)
    t2 = time.perf_counter()
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    t3 = time.perf_counter()
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    placements = str(tuple(model.layers[0].attention.wq.weight.placements))
    return dict(mesh_s=t1 - t0, build_s=t2 - t1, shard_s=t3 - t2, local=local, placements=placements,
                units=len(model.layers) + 1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=512)
    p.add_argument("--hsdp-shard", type=int, default=8, help="shard axis of the HSDP layout (GPUs per host)")
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="ranks to simulate (default: 0 and the last)")
    p.add_argument("--dim", type=int, default=12288)
    p.add_argument("--layers", type=int, default=96)
    p.add_argument("--heads", type=int, default=96)
    p.add_argument("--vocab", type=int, default=50304)
    return p.parse_args(argv)


def main(argv=None) -> None:
    from benchmarks import scale as this  # ranks import the function by module name
    from shardwise.composable import MixedPrecisionPolicy, plan_memory, suggest_mesh
    from tests._dist import run_ranks

    args = parse_args(argv)
    W, S = args.world, args.hsdp_shard
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      max_seq_len=2048)
    with torch.device("meta"):
        model = Llama(cfg)
    n = sum(p.numel() for p in model.parameters())
    print(f"model: {cfg}\n{n / 1e9:.2f} B parameters, {n * 4 / GiB:.1f} GiB in fp32; simulated world {W} "
          f"(fake process group); torch {torch.__version__}\n")
    layouts = [("FULL_SHARD", (W,), (1, W)), ("HYBRID_SHARD", (W // S, S), (W // S, S))]
    print("| layout | mesh | rank | mesh init s | fully_shard s (units) | param bytes on this rank | "
          "plan_memory params | full model / world | placements of wq |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for strategy, shape, plan_shape in layouts:
        plan = plan_memory(model, plan_shape, strategy)
        for rank in args.ranks or [0, W - 1]:
            t0 = time.perf_counter()
            r = run_ranks(this.simulate, 1, rank, W, shape, cfg, init_group=False, timeout=600)[0]
            wall = time.perf_counter() - t0
            print(f"| {strategy} | {shape} | {rank} | {r['mesh_s']:.2f} | {r['shard_s']:.2f} ({r['units']}) | "
                  f"{r['local'] / GiB:.3f} GiB | {plan.params / GiB:.3f} GiB | {n * 4 / shape[-1] / GiB:.3f} GiB | "
                  f"{r['placements']} |", flush=True)
            print(f"    (process wall {wall:.1f} s incl. fork and model build {r['build_s']:.2f} s)", file=sys.stderr)
        print(f"\nplan_memory(model, {plan_shape}, {strategy!r}):\n{plan}\n")
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    print(f"plan_memory(model, (1, {W}), 'FULL_SHARD', mp_policy=bf16 params + fp32 reduce):\n"
          f"{plan_memory(model, (1, W), 'FULL_SHARD', mp_policy=bf16)}\n")
    hosts = W // S
    print(f"suggest_mesh(model, hosts={hosts}, gpus_per_host={S}, bytes_per_gpu=80 GiB, mp_policy=bf16), "
          f"activations not given:")
    print(suggest_mesh(model, hosts, S, 80 * GiB, mp_policy=bf16))


if __name__ == "__main__":
    main()
