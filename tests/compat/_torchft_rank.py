"""One rank of one replica group under torchft, wired as torchtitan 0.2.2's ``FTManager`` wires
it (``torchtitan/components/ft/manager.py``, ``components/optimizer.py``, ``components/checkpoint.py``):

- the replica group is an ordinary FSDP job over its own ranks (its own default process group
  and store, ``MASTER_PORT`` per group); ``fully_shard`` of each ``Linear`` and of the root;
- ``torchft.Manager(pg=ProcessGroupGloo, min_replica_size=1, use_async_quorum=True,
  replica_id="torchtitan_ft_<G>")`` against the lighthouse of ``TORCHFT_LIGHTHOUSE``;
- ``ManagedProcessGroup(manager)`` registered as ``dp_replicate``; every FSDP unit's
  ``set_all_reduce_hook`` all-reduces its reduced gradient over it with ``ReduceOp.AVG``;
- ``torchft.Optimizer(manager, AdamW)``: ``zero_grad`` starts the quorum, ``step`` steps only
  when ``manager.should_commit()``;
- the Manager's state-dict functions serve the *cached* ``get_model_state_dict`` /
  ``get_optimizer_state_dict`` taken once at start (as torchtitan does: it relies on the
  training updating those tensors in place), and load through ``set_*_state_dict``.

Run as ``python -m tests.compat._torchft_rank --impl torch|shardwise ...`` (`tests/compat/_torchft_groups.py`
starts the processes). ``--impl shardwise`` rebinds torch's FSDP2 / DCP names to shardwise's
before anything imports them (only the imports change); the rank asserts which implementation's
``FSDPModule`` its units are. Each rank appends one JSON line per step to ``--log``:
``{"step", "committed", "participants", "participating", "sha", "hook", "live", "t"}`` — ``step`` the manager's step after
the step, ``participating`` False on a step this group healed in (torchft zeroes its contribution),
``sha`` a digest of this rank's parameter and optimizer shards (``psha``: of its parameters), ``hook`` per hook call the sum
of the reduced gradient before and after the all-reduce over the groups, ``live`` whether the
served (cached) state dict equals the parameters, ``t`` the wall time of the step. It stops when the manager's
step reaches the number written in ``<--dir>/stop`` (the launcher writes it), or ``--steps``.

``--die-at S`` makes group rank ``--die-rank`` leave by ``os._exit(1)`` when it is at step S.
``--layout`` varies what a bad peer would: ``fsdp`` (default), ``fsdp-root`` (only the root is
a unit: another wrap), ``hsdp`` (replicate x shard inside the group), ``tp`` (FSDP x TP inside
the group). ``--semi-sync diloco|localsgd --sync-every K`` trains through
``torchft.local_sgd`` instead of the per-step all-reduce.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from datetime import timedelta

IN, HID = 8, 16


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=("torch", "shardwise"), required=True)
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--die-at", type=int, default=-1)
    p.add_argument("--die-rank", type=int, default=1)
    p.add_argument("--layout", default="fsdp", choices=("fsdp", "fsdp-root", "hsdp", "tp"))
    p.add_argument("--semi-sync", default="", choices=("", "diloco", "localsgd"))
    p.add_argument("--sync-every", type=int, default=2)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--pace", type=float, default=0.0, help="least seconds a step takes")
    p.add_argument("--width", type=int, default=HID, help="hidden width (the benchmark's state size)")
    p.add_argument("--sync-quorum", action="store_true", help="use_async_quorum=False: a heal is loaded in "
                   "zero_grad(), before the step's collectives (torchtitan's async quorum loads it in step())")
    p.add_argument("--fresh-state-dict", action="store_true", help="the served state calls model.state_dict() "
                   "at each request (from torchft's quorum thread, during the forward) instead of the cached dict")
    p.add_argument("--slow-forward", type=float, default=0.0, help="seconds the second layer's forward waits "
                   "(its parameters gathered): a window for the quorum thread")
    p.add_argument("--measure-bytes", action="store_true", help="last record: the bytes a heal sends from this rank")
    p.add_argument("--wait-go", action="store_true",
                   help="heartbeat first, then wait for <dir>/go: the groups' first quorum has them all")
    return p.parse_args(argv)


def _model(width: int):
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, width), torch.nn.ReLU(), torch.nn.Linear(width, IN))


def _shard(model, layout: str, world: int):
    """Shard as the group's job does; return the FSDP units. Imports by torch's names (rebound for
    shardwise), and checks in the rank whose ``FSDPModule`` they are."""
    import torch.distributed.fsdp as fsdp_names
    from torch.distributed.device_mesh import init_device_mesh
    FSDPModule, fully_shard = fsdp_names.FSDPModule, fsdp_names.fully_shard
    if layout == "tp":
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp_shard"])
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (world // 2, 2) if world >= 4 else (world, 1),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        mesh = init_device_mesh("cpu", (world,))
        if layout == "fsdp":
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    impl = os.environ["SW_FT_IMPL"]
    owner = FSDPModule.__module__.split(".")[0]  # "torch" or "shardwise": whose class the name reached
    assert units and owner == impl, (
        f"the units are {owner}'s ({FSDPModule.__module__}), the run is {impl}'s")
    return units


def _digest(model, optim=None) -> str:
    """Of this rank's parameter shards, and of its optimizer state with ``optim``."""
    import torch
    from torch.distributed.tensor import DTensor
    h = hashlib.sha256()
    for p in model.parameters():
        state = optim.state.get(p, {}) if optim is not None else {}
        for t in [p] + [v for v in state.values() if isinstance(v, torch.Tensor)]:
            local = t.to_local() if isinstance(t, DTensor) else t
            h.update(local.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _local(t):
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _leaves(obj):
    import torch
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)


def _batch(group: int, step: int, layout: str):
    """This rank's batch: by group, step and data-parallel rank (the tensor-parallel ranks of a
    group share theirs)."""
    import torch
    dp_rank = 0 if layout == "tp" else int(os.environ["RANK"])
    g = torch.Generator().manual_seed(1000 * group + 10 * step + dp_rank)
    x = torch.randn(4, IN, generator=g)
    return x, x.flip(-1)


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    os.environ["SW_FT_IMPL"] = a.impl
    sys.path.insert(0, os.getcwd())
    from tests.compat._rebind import use
    use(a.impl)
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.distributed_c10d import ReduceOp
    import torchft as ft
    from torchft.process_group import ManagedProcessGroup

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # the group's own collectives outwait torchft's (as torchtitan's 300 s init timeout outwaits its
    # 10 s ft process-group timeout): a rank held in torchft's reconfiguration (a peer group died
    # or never had this group rank) fails its step there, not its group's next all-gather
    dist.init_process_group("gloo", timeout=timedelta(seconds=3 * a.timeout))
    model = _model(a.width)
    units = _shard(model, a.layout, world)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    timeout = timedelta(seconds=a.timeout)
    semi = a.semi_sync != ""
    cache: dict = {}

    def state_dict():  # torchtitan's: the cached dicts, taken once
        return {"model": model.state_dict() if a.fresh_state_dict else cache["model"], "optim": cache["optim"]}

    if a.slow_forward:
        model[2].register_forward_pre_hook(lambda *_: time.sleep(a.slow_forward))

    def load_state_dict(sd):
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, optim, sd["optim"])
        cache["model"] = get_model_state_dict(model)
        cache["optim"] = get_optimizer_state_dict(model, optim)

    manager = ft.Manager(pg=ft.ProcessGroupGloo(timeout=timeout), min_replica_size=1,
                         load_state_dict=None, state_dict=None, use_async_quorum=not (semi or a.sync_quorum),
                         replica_id=f"torchtitan_ft_{a.group}", timeout=timeout,
                         quorum_timeout=timeout, connect_timeout=timeout)
    hook_seen: list[tuple[float, float]] = []  # per hook call: (sum of its input, sum after the all-reduce)
    if not semi:
        replicate_pg = ManagedProcessGroup(manager)
        replicate_pg.register("dp_replicate")

        def all_reduce_hook(output):
            before = float(output.double().sum())
            dist.all_reduce(output, group=replicate_pg, op=ReduceOp.AVG)
            hook_seen.append((before, float(output.double().sum())))

        for m in units:
            m.set_all_reduce_hook(all_reduce_hook)
    # torchtitan forces the optimizer state before caching (so state_dict() never steps it)
    cache["model"] = get_model_state_dict(model)
    cache["optim"] = get_optimizer_state_dict(model, optim)
    manager.set_state_dict_fns(load_state_dict, state_dict)
    log = open(a.log, "a", buffering=1)
    if a.wait_go:
        open(os.path.join(a.dir, f"ready.g{a.group}r{rank}"), "w").close()
        deadline = time.monotonic() + a.timeout
        while not os.path.exists(os.path.join(a.dir, "go")):
            assert time.monotonic() < deadline, "no go from the launcher"
            time.sleep(0.05)
    stop_file = os.path.join(a.dir, "stop")

    def stop_at() -> int:
        try:
            return int(open(stop_file).read().strip() or a.steps)
        except (OSError, ValueError):
            return a.steps

    def record(committed: bool, t: float) -> None:
        log.write(json.dumps({"step": manager.current_step(), "committed": committed,
                              "participants": manager.num_participants(),
                              "participating": manager.is_participating(),
                              "sha": _digest(model, optim), "psha": _digest(model), "hook": hook_seen, "live": live(), "t": t}) + "\n")

    def live() -> bool:  # the served (cached) state dict is the model's current state
        params = dict(model.named_parameters())
        return all(torch.equal(_local(v), _local(params[k])) for k, v in cache["model"].items() if k in params)

    def forward_backward(step: int) -> None:
        x, y = _batch(a.group, step, a.layout)
        torch.nn.functional.mse_loss(model(x), y).backward()

    try:
        if semi:
            _semi_sync(a, manager, model, optim, record, forward_backward, stop_at)
        else:
            opt = ft.Optimizer(manager, optim)
            while manager.current_step() < stop_at():
                t0 = time.perf_counter()
                if manager.current_step() == a.die_at and rank == a.die_rank:
                    os._exit(1)
                hook_seen.clear()
                opt.zero_grad()
                forward_backward(manager.current_step())
                before = manager.current_step()
                opt.step()
                took = time.perf_counter() - t0
                if a.pace:
                    time.sleep(max(0.0, a.pace - took))
                record(manager.current_step() > before, took)
        if a.measure_bytes:  # what a heal sends from this rank: torchft's HTTP body for the served state
            import io
            from torchft.checkpointing._serialization import _streaming_save
            body = io.BytesIO()
            _streaming_save(manager._manager_state_dict(), body)
            tensors = [_local(v) for part in state_dict().values() for v in _leaves(part)]
            log.write(json.dumps({"sent_bytes": body.tell(), "state_bytes": sum(t.nbytes for t in tensors)}) + "\n")
    finally:
        log.close()
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def _semi_sync(a, manager, model, optim, record, forward_backward, stop_at) -> None:
    """torchtitan's ``maybe_semi_sync_training``: ``DiLoCo`` (outer SGD, lr 0.7, Nesterov 0.9)
    or ``LocalSGD`` around the inner loop; the manager's step counts outer syncs."""
    import torch
    from torchft import local_sgd
    rank = int(os.environ["RANK"])
    if a.semi_sync == "diloco":
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        ctx = local_sgd.DiLoCo(manager=manager, model_fragments=[model], inner_optimizer=optim,
                               outer_optimizer=[outer], sync_every=a.sync_every)
    else:
        ctx = local_sgd.LocalSGD(manager=manager, model=model, optimizer=optim, sync_every=a.sync_every)
    inner = 0
    with ctx:
        while manager.current_step() < stop_at():
            t0 = time.perf_counter()
            if manager.current_step() == a.die_at and rank == a.die_rank and inner % a.sync_every == 1:
                os._exit(1)
            before = manager.current_step()
            optim.zero_grad()
            forward_backward(1000 * before + inner)
            optim.step()  # the hooks of DiLoCo / LocalSGD sync every sync_every inner steps
            inner += 1
            took = time.perf_counter() - t0
            if a.pace:
                time.sleep(max(0.0, a.pace - took))
            if inner % a.sync_every == 0:
                record(manager.current_step() > before, took)


if __name__ == "__main__":
    main()
