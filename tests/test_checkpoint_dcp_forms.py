"""Everyday torch DCP call forms (issue 33, items 3-8), torch's DCP as the oracle: key names of
compiled and DDP models, the optimizer's own id-keyed state dict, one order of `Stateful`
calls on every rank, ``bytes`` values (per rank where they differ), the ``.metadata`` marker,
full state dicts into a meta-device ``fully_shard`` model."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as torch_sd
import torch.nn as nn

import shardwise.checkpoint as ck
from tests._dist import run_ranks


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 3)))


def _stepped(model: nn.Module) -> torch.optim.Optimizer:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    optim.zero_grad()
    return optim


def _same_keys_and_values(ours, theirs, where: str) -> None:
    assert isinstance(ours, dict) and isinstance(theirs, dict), where
    assert list(ours) == list(theirs), f"{where}: keys {list(ours)} != torch's {list(theirs)}"
    for k in ours:
        a, b = ours[k], theirs[k]
        if isinstance(b, dict):
            _same_keys_and_values(a, b, f"{where}/{k}")
        elif isinstance(b, torch.Tensor):
            assert torch.equal(a, b), f"{where}/{k}"
        else:
            assert a == b, f"{where}/{k}: {a!r} != {b!r}"


# -- item 5: names of compiled and DDP models ---------------------------------------------------


def _check_names_like_torch(model: nn.Module, optim: torch.optim.Optimizer, fresh: nn.Module) -> None:
    msd, osd = ck.get_state_dict(model, optim)
    tmsd, tosd = torch_sd.get_state_dict(model, optim)
    _same_keys_and_values(msd, tmsd, "model")
    assert list(osd["state"]) == list(tosd["state"]), (list(osd["state"]), list(tosd["state"]))
    assert [g["params"] for g in osd["param_groups"]] == [g["params"] for g in tosd["param_groups"]]
    assert not any("_orig_mod" in k or k.startswith("module.") for k in msd), list(msd)
    # set_* takes the stripped names (torch's) and the wrapped ones (model.state_dict()'s)
    fresh_optim = _stepped(fresh)
    ck.set_state_dict(fresh, fresh_optim, model_state_dict=tmsd, optim_state_dict=tosd)
    for (n, p), q in zip(fresh.named_parameters(), model.parameters()):
        assert torch.equal(p, q), n
    ck.set_model_state_dict(fresh, model.state_dict())


def test_compiled_model_keys_match_torch():
    model = torch.compile(_net(0))
    fresh = torch.compile(_net(1))
    _check_names_like_torch(model, _stepped(model), fresh)
    assert list(ck.get_model_state_dict(model, submodules=[model._orig_mod[2]],
                                        options=ck.StateDictOptions(keep_submodule_prefixes=True))) == \
        ["2.0.weight", "2.0.bias"]


def _ddp_names(rank, world_size):
    model = nn.parallel.DistributedDataParallel(_net(0))
    fresh = nn.parallel.DistributedDataParallel(_net(1))
    _check_names_like_torch(model, _stepped(model), fresh)
    return True


def test_ddp_model_keys_match_torch():
    assert run_ranks(_ddp_names, 2, timeout=90) == [True, True]


# -- item 6: the optimizer's own state dict -----------------------------------------------------


def test_set_optimizer_state_dict_takes_the_optimizers_own_form():
    model = _net(0)
    optim = _stepped(model)
    fresh = _net(0)
    fresh_optim = _stepped(fresh)
    ck.set_optimizer_state_dict(fresh, fresh_optim, optim.state_dict())
    torch_fresh = _net(0)
    torch_optim = _stepped(torch_fresh)
    torch_sd.set_optimizer_state_dict(torch_fresh, torch_optim, optim.state_dict())
    _same_keys_and_values(fresh_optim.state_dict(), torch_optim.state_dict(), "optim")
    _same_keys_and_values(fresh_optim.state_dict(), optim.state_dict(), "optim")


# -- item 8: one order of Stateful calls on every rank ------------------------------------------


class _Collective:
    """A Stateful whose state_dict / load_state_dict run a collective naming itself."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.n = name, log, 0

    def _sync(self, what: str) -> None:
        got: list = [None] * dist.get_world_size()
        dist.all_gather_object(got, f"{what}:{self.name}")
        self.log.append(got)

    def state_dict(self):
        self._sync("state_dict")
        return {"n": self.n}

    def load_state_dict(self, sd):
        self._sync("load_state_dict")
        self.n = sd["n"]


def _orders(rank, world_size, path):
    log: list = []
    names = ["b", "a", "c"] if rank == 0 else ["c", "a", "b"]
    ck.save({n: _Collective(n, log) for n in names}, checkpoint_id=path)
    ck.load({n: _Collective(n, log) for n in reversed(names)}, checkpoint_id=path)
    return log


def test_stateful_calls_run_in_one_order_on_every_rank(tmp_path):
    for log in run_ranks(_orders, 2, str(tmp_path / "c"), timeout=90):
        mixed = [got for got in log if len(set(got)) != 1]
        assert not mixed, f"ranks called different statefuls in one collective: {mixed}"
        want = [f"{w}:{n}" for w in ("state_dict", "state_dict", "load_state_dict") for n in "abc"]
        assert [got[0] for got in log] == want, [got[0] for got in log]


# -- item 3: bytes values, per rank where they differ ------------------------------------------


def _bytes_state(rank: int) -> dict:
    return {"dataloader": {f"dp_rank_{rank}": pickle.dumps({"rank": rank, "pos": [rank] * 5}), "world_size": 2},
            "shared": bytes(range(256)) * 3, "empty": b"", "mine": os.urandom(0) + f"rank {rank}".encode(),
            "step": 7, "w": torch.arange(6.0)}


def _blank(rank: int) -> dict:
    return {"dataloader": {f"dp_rank_{rank}": b"", "world_size": 0}, "shared": b"", "empty": b"x", "mine": b"",
            "step": 0, "w": torch.zeros(6)}


def _bytes_save(rank, world_size, ours, theirs):
    ck.save(_bytes_state(rank), ours)
    dcp.save(_bytes_state(rank), checkpoint_id=theirs)
    a, b = _blank(rank), _blank(rank)
    ck.load(a, ours)
    dcp.load(b, checkpoint_id=theirs)
    return a, b


def _bytes_reload(rank, world_size, ours):
    try:  # collective: rank 2 saved none of the per-rank values, so every rank raises its problems
        ck.load(_blank(rank), ours)
    except ck.CheckpointError as e:
        message = str(e)
    else:
        message = "loaded"
    partial = {k: v for k, v in _blank(rank).items() if k in ("shared", "empty", "step", "w")}
    ck.load(partial, ours)
    kept = _blank(rank)
    ck.load(kept, ours, strict=False)
    return message, partial, kept


def test_bytes_values_round_trip_per_rank_and_reshard(tmp_path):
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    for rank, (a, b) in enumerate(run_ranks(_bytes_save, 2, ours, theirs, timeout=90)):
        want = _bytes_state(rank)
        assert a["dataloader"] == want["dataloader"] == b["dataloader"], (rank, a["dataloader"])
        for k in ("shared", "empty", "step"):
            assert a[k] == want[k] == b[k] and type(a[k]) is type(want[k]), (rank, k, a[k])
        # one key, a value per rank: each rank gets its own back (DCP keeps one rank's for all)
        assert a["mine"] == want["mine"] and b["mine"] in (b"rank 0", b"rank 1"), (rank, a["mine"], b["mine"])
        assert torch.equal(a["w"], want["w"])
    index = ck.verify_checkpoint(ours)
    assert index.ok, index
    out = run_ranks(_bytes_reload, 3, ours, timeout=90)
    for rank in (0, 1):
        kept = out[rank][2]
        assert kept["dataloader"] == _bytes_state(rank)["dataloader"] and kept["mine"] == f"rank {rank}".encode()
    message, partial, kept = out[2]
    assert "value 'dataloader/dp_rank_2' is not in" in message, message
    assert "'mine' was saved per rank" in message and "ranks [0, 1]" in message, message
    assert partial["shared"] == bytes(range(256)) * 3 and partial["empty"] == b"" and partial["step"] == 7
    assert kept["mine"] == b"" and kept["shared"] == bytes(range(256)) * 3, kept


def _bytes_after_offline(rank, world_size, path):
    state = _blank(rank)
    ck.load(state, path)
    return state


def test_bytes_values_survive_an_offline_reshard_and_stay_out_of_a_merge(tmp_path):
    """reshard_checkpoint keeps each bytes value a bytes value (not a uint8 tensor) and each
    per-rank value with its rank; merge_checkpoint writes only the model's tensors."""
    src, out = str(tmp_path / "src"), str(tmp_path / "r2")
    run_ranks(_bytes_save, 2, src, str(tmp_path / "theirs"), timeout=90)
    ck.reshard_checkpoint(src, out, 2)
    assert ck.verify_checkpoint(out).ok
    for rank, state in enumerate(run_ranks(_bytes_after_offline, 2, out, timeout=90)):
        want = _bytes_state(rank)
        for k in ("dataloader", "shared", "empty", "mine", "step"):
            assert state[k] == want[k] and type(state[k]) is type(want[k]), (rank, k, state[k])
        assert torch.equal(state["w"], want["w"])
    from safetensors import safe_open

    names = set()
    for f in ck.merge_checkpoint(src, str(tmp_path / "merged"), prefix=""):
        with safe_open(str(tmp_path / "merged" / f), "pt") as st:
            names |= set(st.keys())
    assert names == {"w"}, names


# -- item 4: the .metadata marker ----------------------------------------------------------------


def test_checkpoint_has_dcp_marker_and_torch_dcp_refuses_it(tmp_path):
    for step in (10, 20):
        ck.save({"w": torch.arange(4.0), "step": step}, str(tmp_path / f"step-{step}"), keep_last=1)
    # torchtitan's discovery: the newest step-N folder holding a .metadata file
    found = [d for d in os.listdir(tmp_path) if os.path.isfile(tmp_path / d / ".metadata")]
    assert found == ["step-20"], found
    assert ck.verify_checkpoint(str(tmp_path / "step-20")).ok
    target = {"w": torch.zeros(4), "step": 0}
    with pytest.raises(BaseException) as e:  # DCP's CheckpointException is a BaseException
        dcp.load(target, checkpoint_id=str(tmp_path / "step-20"))
    assert "this is a shardwise checkpoint" in str(e.value) and "shardwise.checkpoint.load" in str(e.value), e.value
    assert torch.equal(target["w"], torch.zeros(4)) and target["step"] == 0
    with pytest.raises(BaseException, match="this is a shardwise checkpoint"):
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path / "step-20")))
    ck.load(target, str(tmp_path / "step-20"))
    assert torch.equal(target["w"], torch.arange(4.0)) and target["step"] == 20
    ck.save({"w": torch.ones(4)}, str(tmp_path / "step-20"))  # a replace keeps no stale marker problem
    assert sorted(os.listdir(tmp_path / "step-20")) == [".metadata", "index.json", "rank-00000.safetensors"]


# -- item 7: a full state dict into a fully_shard model on the meta device -----------------------


def _meta_full(rank, world_size, broadcast):
    from shardwise.composable import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    full = _net(3).state_dict()
    with torch.device("meta"):
        model = _net(0)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    options = ck.StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    ck.set_model_state_dict(model, full if rank == 0 or not broadcast else {}, options=options)
    assert not any(p.device.type == "meta" for p in model.parameters()), "parameters left on meta"
    got = ck.get_model_state_dict(model, options=ck.StateDictOptions(full_state_dict=True))
    for k, v in full.items():
        assert torch.equal(got[k], v), k
    x = torch.ones(2, 4)
    return torch.equal(model(x), _net(3)(x))


@pytest.mark.parametrize("broadcast", [False, True])
def test_full_state_dict_into_meta_fully_shard_model(broadcast):
    assert run_ranks(_meta_full, 2, broadcast, timeout=90) == [True, True]
