"""torch DCP's call forms on shardwise.checkpoint: ``checkpoint_id=``, `Stateful` values at any
depth, the async handle as ``Future`` / ``AsyncSaveResponse``, ``process_group`` / ``no_dist``,
refused extension points, and ``get_state_dict`` / ``set_state_dict`` with DCP's
``StateDictOptions`` checked against torch's own helpers (the oracle)."""

from __future__ import annotations

import concurrent.futures
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as torch_sd
import torch.nn as nn

import shardwise.checkpoint as ck
from tests._dist import run_ranks
from tests.test_checkpoint import build, full, train


class Counter:
    """A user's Stateful (not a dict, not a module)."""

    def __init__(self, n: int = 0, w: torch.Tensor | None = None) -> None:
        self.n, self.w, self.loaded = n, torch.zeros(3) if w is None else w, 0

    def state_dict(self):
        return {"n": self.n, "w": self.w}

    def load_state_dict(self, sd):
        self.n, self.loaded = sd["n"], self.loaded + 1
        assert sd["w"] is self.w, "load_state_dict must get the dict its state_dict() returned, filled"


class Outer:
    def __init__(self, inner: Counter, seen: list) -> None:
        self.inner, self.seen = inner, seen

    def state_dict(self):
        return {"inner": self.inner, "tag": "outer"}

    def load_state_dict(self, sd):
        self.seen.append(("outer", self.inner.loaded))  # the inner one was restored first


def test_stateful_protocol_and_nested_values(tmp_path):
    assert isinstance(Counter(), ck.Stateful) and isinstance(nn.Linear(2, 2), ck.Stateful)
    assert not isinstance(torch.zeros(1), ck.Stateful) and not isinstance({}, ck.Stateful)
    lin = nn.Linear(3, 2)
    seen: list = []
    state = {"run": {"counter": Counter(5, torch.arange(3.0)), "outer": Outer(Counter(2, torch.ones(3)), seen),
                     "model": lin}, "step": 7}
    path = str(tmp_path / "c")
    ck.save(state, checkpoint_id=path)
    lin2 = nn.Linear(3, 2)
    c2, inner2 = Counter(), Counter()
    target = {"run": {"counter": c2, "outer": Outer(inner2, seen), "model": lin2}, "step": 0}
    ck.load(target, checkpoint_id=path)
    assert (c2.n, c2.loaded, inner2.n) == (5, 1, 2) and torch.equal(c2.w, torch.arange(3.0))
    assert torch.equal(inner2.w, torch.ones(3)) and seen == [("outer", 1)]
    assert torch.equal(lin2.weight, lin.weight) and torch.equal(lin2.bias, lin.bias)
    assert target["step"] == 7, "a plain value next to a stateful is put back into the caller's dict"
    assert isinstance(target["run"]["counter"], Counter), "the caller's tree keeps its objects"


def test_path_forms_and_refused_extension_points(tmp_path):
    state = {"w": torch.arange(4.0)}
    ck.save(state, str(tmp_path / "a"))  # shardwise's own form still works
    ck.save(state_dict=state, checkpoint_id=tmp_path / "b")  # DCP's keywords, a PathLike
    got = {"w": torch.zeros(4)}
    ck.load(state_dict=got, checkpoint_id=str(tmp_path / "b"))
    assert torch.equal(got["w"], state["w"])
    with pytest.raises(TypeError, match="two paths"):
        ck.save(state, str(tmp_path / "a"), checkpoint_id=str(tmp_path / "b"))
    with pytest.raises(TypeError, match="needs the checkpoint's path"):
        ck.load(state)
    for call, kw, way in [(ck.save, {"storage_writer": object()}, "storage="),
                          (ck.load, {"storage_reader": object()}, "storage="),
                          (ck.save, {"planner": object()}, "plans from the state"),
                          (ck.async_save, {"async_stager": object()}, "copies the state to CPU"),
                          (ck.save, {"use_collectives": False}, "use_collectives")]:
        with pytest.raises(TypeError, match=way):
            call(state, checkpoint_id=str(tmp_path / "c"), **kw)
    with pytest.raises(ValueError, match="'thread' or 'process'"):  # PROCESS is taken: tests/test_checkpoint_async_process.py
        ck.async_save(state, checkpoint_id=str(tmp_path / "c"), async_checkpointer_type="gpu")
    assert not os.path.exists(tmp_path / "c")


def test_async_handle_is_a_future(tmp_path):
    state = {"w": torch.arange(6.0), "step": 3}
    handle = ck.async_save(state, checkpoint_id=str(tmp_path / "a"))
    calls = []
    handle.add_done_callback(lambda f: calls.append(f))
    assert handle.staging_completion.done() and handle.staging_completion.result() is None
    assert handle.upload_completion is handle and not handle.cancel() and not handle.cancelled()
    first = handle.result(timeout=60)
    assert handle.result() == first and handle.exception() is None and handle.done() and not handle.running()
    assert calls == [handle]
    handle.add_done_callback(lambda f: calls.append("late"))  # already finished: runs at once
    assert calls == [handle, "late"] and handle.wait() == []
    done, _ = concurrent.futures.wait([handle.staging_completion], timeout=1)
    assert len(done) == 1
    got = {"w": torch.zeros(6), "step": 0}
    ck.load(got, str(tmp_path / "a"))
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3


def test_async_handle_reports_a_failure_as_a_future_does(tmp_path, monkeypatch):
    from shardwise.checkpoint._save import _save_handle as _writer

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_writer, "_write_file", fail)
    handle = ck.async_save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "a"))
    error = handle.exception()
    assert isinstance(error, ck.CheckpointError) and "No space left" in str(error)
    with pytest.raises(ck.CheckpointError, match="No space left"):
        handle.result()  # the same error again
    assert not os.path.exists(tmp_path / "a")


def _group_and_no_dist(rank, world_size, path):
    model, optim = build("fsdp2")
    train(model, optim, 1)
    app = {"model": model, "optim": optim}  # DCP's shortest form: the module and optimizer themselves
    ck.save(app, checkpoint_id=f"{path}/whole", process_group=dist.group.WORLD)
    model2, optim2 = build("fsdp2", seed=3)
    ck.load({"model": model2, "optim": optim2}, checkpoint_id=f"{path}/whole", process_group=dist.new_group())
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), model2.parameters()))
    own = [dist.new_group([r]) for r in range(world_size)]  # e.g. one HSDP shard group per rank
    try:
        ck.save(app, checkpoint_id=f"{path}/sub", process_group=own[rank])
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    dist.barrier()
    # no_dist: each process alone, its own path, plain tensors; no collective is made (rank 1 only)
    mine = {"rank": torch.tensor([rank]), "note": f"r{rank}"}
    if rank == 1:
        ck.save(mine, checkpoint_id=f"{path}/alone-{rank}", no_dist=True)
        handle = ck.async_save(mine, checkpoint_id=f"{path}/alone-async-{rank}", no_dist=True)
        handle.result()
        got = {"rank": torch.tensor([-1]), "note": ""}
        ck.load(got, checkpoint_id=f"{path}/alone-async-{rank}", no_dist=True)
        try:
            ck.save({"model": model}, checkpoint_id=f"{path}/sharded-alone", no_dist=True)
            alone_sharded = "no error"
        except ValueError as e:
            alone_sharded = str(e)
        alone = (int(got["rank"]), got["note"], "spread over 2 ranks" in alone_sharded)
    else:
        alone = None
    dist.barrier()
    return same, refused, alone


def test_process_group_and_no_dist(tmp_path):
    out = run_ranks(_group_and_no_dist, 2, str(tmp_path), timeout=90)
    assert all(same for same, _, _ in out), "module + optimizer passed as Stateful values did not round-trip"
    assert all("process_group has 1 of the 2 ranks" in r[1] for r in out), out
    assert out[1][2] == (1, "r1", True), out[1][2]
    assert os.path.isdir(tmp_path / "alone-1") and not os.path.exists(tmp_path / "sub")


# -- get_state_dict / set_state_dict against torch's helpers (one process, plain modules) ------------
class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pretrain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
        self.head = nn.Linear(3, 2)
        self.register_buffer("scale", torch.ones(2))

    def forward(self, x):
        return self.head(self.pretrain(x)) * self.scale


def _stepped(frozen: bool = False):
    model = Two()
    if frozen:
        model.pretrain[0].requires_grad_(False)
    o1 = torch.optim.AdamW(model.pretrain.parameters(), lr=1e-2)
    o2 = torch.optim.SGD(model.head.parameters(), lr=1e-1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    o1.step(), o2.step()
    return model, o1, o2


def _flat(v, key=""):
    if isinstance(v, dict):
        return {k2: x for k, x2 in v.items() for k2, x in _flat(x2, f"{key}/{k}").items()}
    if isinstance(v, (list, tuple)) and any(isinstance(x, (dict, torch.Tensor)) for x in v):
        return {k2: x for i, x2 in enumerate(v) for k2, x in _flat(x2, f"{key}/{i}").items()}
    return {key: v}


def _same(ours, theirs, where):
    a, b = _flat(ours), _flat(theirs)
    assert a.keys() == b.keys(), f"{where}: keys differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        x, y = a[k], b[k]
        ok = torch.equal(x, y) if isinstance(x, torch.Tensor) else list(x) == list(y) if isinstance(x, tuple) else x == y
        assert ok, f"{where}: {k}: {x!r} vs torch's {y!r}"


@pytest.mark.parametrize("fields", [
    {}, {"flatten_optimizer_state_dict": True}, {"ignore_frozen_params": True}, {"cpu_offload": True},
    {"keep_submodule_prefixes": False},
])
def test_get_state_dict_matches_torch(fields):
    model, o1, o2 = _stepped(frozen=fields.get("ignore_frozen_params", False))
    subs = {model.pretrain} if "keep_submodule_prefixes" in fields else None
    ours = ck.get_state_dict(model, [o1, o2], submodules=subs, options=ck.StateDictOptions(**fields))
    with pytest.warns(FutureWarning) if subs else _nothing():
        theirs = torch_sd.get_state_dict(model, [o1, o2], submodules=subs, options=torch_sd.StateDictOptions(**fields))
    _same(ours[0], theirs[0], f"model state dict, {fields}")
    _same(ours[1], theirs[1], f"optimizer state dict, {fields}")


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("flat", [False, True])
def test_set_state_dict_restores_several_optimizers(flat):
    model, o1, o2 = _stepped()
    options = ck.StateDictOptions(flatten_optimizer_state_dict=flat)
    msd, osd = ck.get_state_dict(model, (o1, o2), options=options)
    want = {k: v.clone() for k, v in _flat(osd).items() if isinstance(v, torch.Tensor)}
    m2 = Two()
    with torch.no_grad():
        for p in m2.parameters():
            p.add_(1.0)
    p1 = torch.optim.AdamW(m2.pretrain.parameters(), lr=5.0)
    p2 = torch.optim.SGD(m2.head.parameters(), lr=5.0, momentum=0.1)
    result = ck.set_state_dict(m2, [p1, p2], model_state_dict=msd, optim_state_dict=osd)
    assert not result.missing_keys and not result.unexpected_keys
    assert p1.param_groups[0]["lr"] == 1e-2 and p2.param_groups[0]["lr"] == 1e-1
    assert p2.param_groups[0]["momentum"] == 0.9
    _same(dict(m2.state_dict()), dict(model.state_dict()), "model after set_state_dict")
    back = ck.get_state_dict(m2, (p1, p2), options=options)[1]
    got = {k: v for k, v in _flat(back).items() if isinstance(v, torch.Tensor)}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    theirs = torch_sd.get_state_dict(m2, [p1, p2], options=torch_sd.StateDictOptions(flatten_optimizer_state_dict=flat))
    _same(back, theirs[1], "optimizer state after set_state_dict vs torch's view of it")


def test_broadcast_needs_full_state_dict():
    with pytest.raises(ValueError, match="full_state_dict=True"):
        ck.StateDictOptions(broadcast_from_rank0=True)


def _full_options(rank, world_size):
    model, optim = build("fsdp2")
    train(model, optim, 1)
    fopts = ck.StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)
    msd, osd = ck.get_state_dict(model, optim, options=fopts)
    model2, optim2 = build("fsdp2", seed=4)
    ck.set_state_dict(model2, optim2, model_state_dict=msd, optim_state_dict=osd,
                      options=ck.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    a = full({"m": ck.get_model_state_dict(model), "o": ck.get_optimizer_state_dict(model, optim)})
    b = full({"m": ck.get_model_state_dict(model2), "o": ck.get_optimizer_state_dict(model2, optim2)})
    return (len(msd) > 0, sorted(k for k in a if not torch.equal(a[k], b[k])))


def test_full_flat_state_dict_broadcast_from_rank0():
    out = run_ranks(_full_options, 2, timeout=90)
    assert [has for has, _ in out] == [True, False], "cpu_offload + full_state_dict: rank 0 only"
    assert all(not bad for _, bad in out), out


def test_result_with_a_timeout_waits_for_this_ranks_write_only(tmp_path, monkeypatch):
    import threading

    from shardwise.checkpoint._save import _save_handle as _writer

    release = threading.Event()
    real = _writer._write_file
    monkeypatch.setattr(_writer, "_write_file", lambda *a: (release.wait(), real(*a))[1])
    handle = ck.async_save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "a"))
    with pytest.raises(concurrent.futures.TimeoutError, match="still being written"):
        handle.result(timeout=0.05)
    assert not handle.done() and handle.running() and not os.path.exists(tmp_path / "a")
    release.set()
    handle.result(timeout=60)  # the same handle finishes later
    assert handle.done() and not handle.running() and os.path.isdir(tmp_path / "a")


def test_default_planners_are_taken_and_custom_ones_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(4.0), "step": 3}
    path = str(tmp_path / "a")
    ck.save(state, checkpoint_id=path, planner=ck.DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    got = {"w": torch.zeros(4), "step": 0}
    ck.load(got, checkpoint_id=path, planner=ck.DefaultLoadPlanner())
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3
    extra = {"w": torch.zeros(4), "new": torch.full((2,), 5.0)}  # a key the checkpoint lacks
    with pytest.raises(ck.CheckpointError, match="new"):
        ck.load(extra, checkpoint_id=path, planner=ck.DefaultLoadPlanner())
    ck.load(extra, checkpoint_id=path, planner=ck.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(extra["w"], state["w"]) and torch.equal(extra["new"], torch.full((2,), 5.0))

    class Custom(ck.DefaultSavePlanner):
        pass

    for call, planner in [(ck.save, Custom()), (ck.save, ck.DefaultLoadPlanner()), (ck.load, ck.DefaultSavePlanner()),
                          (ck.save, dcp.DefaultSavePlanner())]:  # torch's own: a planner shardwise does not run
        with pytest.raises(TypeError, match="plans from the state"):
            call(dict(got), checkpoint_id=str(tmp_path / "b"), planner=planner)
    for cls in (ck.DefaultSavePlanner, ck.DefaultLoadPlanner):
        with pytest.raises(ValueError, match=f"{cls.__name__}\\(flatten_state_dict=\\.\\.\\.\\)"):
            cls(flatten_state_dict=False)
    assert not os.path.exists(tmp_path / "b")


def test_top_level_values_of_a_load_equal_torch_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    src = {"t": torch.arange(4.0), "step": 7, "lst": [1, torch.ones(2)], "tup": (1, 2.5), "nested": {"a": 5},
           "s": "hi", "none": 3}
    dcp.save(src, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    ck.save(src, str(tmp_path / "ours"), no_dist=True)
    loaded = []
    for load, path in ((lambda s, p: dcp.load(s, checkpoint_id=p, no_dist=True), "torch"),
                       (lambda s, p: ck.load(s, p, no_dist=True), "ours")):
        t = torch.zeros(4)
        target = {"t": t, "step": 0, "lst": [0, torch.zeros(2)], "tup": (0, 0.0), "nested": {"a": 0}, "s": "",
                  "none": None}
        load(target, str(tmp_path / path))
        assert target["t"] is t, f"{path}: a top-level tensor is filled in place"
        loaded.append(target)
    theirs, ours = loaded
    assert repr(ours) == repr(theirs), (ours, theirs)


def _ddp_missing_keys(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)))
    partial = {"0.weight": torch.ones(2, 2)}
    ours = ck.set_model_state_dict(model, partial, options=ck.StateDictOptions(strict=False))
    theirs = torch_sd.set_model_state_dict(model, partial, options=torch_sd.StateDictOptions(strict=False))
    return sorted(ours.missing_keys), sorted(theirs.missing_keys), sorted(ours.unexpected_keys)


def test_set_model_state_dict_on_ddp_reports_keys_as_torch():
    # torch 2.13 reports them as DDP's load_state_dict names them (module.*), as shardwise does
    ours, theirs, unexpected = run_ranks(_ddp_missing_keys, 1)[0]
    assert ours == theirs == ["module.0.bias", "module.1.bias", "module.1.weight"] and unexpected == [], (ours, theirs)
