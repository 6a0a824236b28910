"""A sharded model's tensors are ordinary tensors: what users do with them, torch FSDP2 vs shardwise.

The battery: every tensor a user reaches from a sharded model -- the parameters (``param``), their
``to_local()`` (``local``), gradients (``grad``), ``model.state_dict()`` (``sd``), the full state
dict of ``get_model_state_dict(full_state_dict=True)`` (``full``) and the optimizer state
(``optim``) -- goes through ``torch.save``/``torch.load`` (``save``; ``load_safe`` with torch's
default ``weights_only=True``), ``pickle``, ``copy.deepcopy``, a ``multiprocessing`` queue's
pickler (``mp``: moves CPU storages into shared memory in place), ``share_memory_()``
(``share``), DLPack and ``.numpy()``. Each case is ``ok`` (the result equals the tensors, bit for
bit), ``differs``, ``error:<type>``, ``invalid`` (not run: a DTensor over a view at a nonzero storage
offset, as torch's FSDP2 gradients are, is serialized through its empty wrapper storage, which
raises or kills the process) or ``n/a`` (``share`` and DLPack on DTensors). Layouts: FSDP, CPU offload, a float8 (torchao, all-gather
extension) model on 2 ranks; HSDP (2 x 2) and FSDP x TP (2 x 2) on 4. States: after an AdamW
step (``step``), after a no-grad forward and ``reshard()`` (``reshard``), after ``unshard()``
(``unshard``). After the battery, which moved storages into shared memory, the model trains two
more steps: their losses prove the all-gathers read what the optimizer wrote.

torch's side is golden data recorded once (``goldens/ordinary_tensors.json``, `tests/compat/_golden.py`);
the test runs shardwise's and requires every case that is ``ok`` on torch to be ``ok`` here,
with the same values (a digest per collection) and the same losses. Regenerate the golden with
``python -m tests.compat.regen_goldens ordinary_tensors`` (torch's side in fresh gloo processes,
[Note: recording torch's side]).
"""

from __future__ import annotations

import copy
import io
import math
import pickle
import pathlib
from typing import Any

import pytest
import torch
import torch.nn as nn

from tests._dist import run_on_workers
from tests.compat._golden import golden as read_golden, recorder

LAYOUTS = {"fsdp": 2, "offload": 2, "float8": 2, "hsdp": 4, "fsdp_tp": 4}
STATES = ("step", "reshard", "unshard")
KINDS = ("param", "local", "grad", "optim", "sd", "full")
DIM, HIDDEN = 16, 32
RTOL = 1e-5  # two implementations' fp32 reductions may round differently


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.head = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM), nn.Linear(DIM, 8)

    def forward(self, x):
        return self.head(self.l1(torch.relu(self.l0(x))))


def _build(impl_name: str, layout: str, rank: int, world: int) -> tuple[nn.Module, Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.compat._adapter import impl

    I = impl(impl_name)  # noqa: E741
    if impl_name == "torch":
        from torch.distributed.fsdp import CPUOffloadPolicy
    else:
        from shardwise.composable import CPUOffloadPolicy  # type: ignore[no-redef]
    torch.manual_seed(0)
    model = _Net()
    kw: dict[str, Any] = {}
    if layout == "float8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                                   module_filter_fn=lambda m, fqn: fqn in ("l0", "l1"))
    if layout == "offload":
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if layout == "hsdp":
        kw["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    if layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        I.parallelize_module(model, mesh["tp"], {"l0": I.ColwiseParallel(), "l1": I.RowwiseParallel()})
        kw["mesh"] = mesh["dp"]
    for m in (model.l0, model.l1, model):
        I.fully_shard(m, **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), I


def _step(model: nn.Module, opt: Any, rank: int, i: int) -> float:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1000 * i + rank)
    loss = model(torch.randn(4, DIM, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total)


def _values(t: torch.Tensor) -> torch.Tensor:
    """The numbers of ``t`` (a DTensor's local shard; torchao's float8 weight wrapper unwrapped)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if isinstance(t, DTensor):
            t = t.to_local()
        inner = getattr(t, "_tensor", None)  # torchao's WeightWithDynamicFloat8CastTensor
        return (inner if isinstance(inner, torch.Tensor) else t).detach().double().reshape(-1)


def _collection(kind: str, model: nn.Module, opt: Any, I: Any) -> dict[str, torch.Tensor]:  # noqa: E741
    """The tensors of ``kind``, taken when asked: after ``unshard()`` the parameters are the
    unsharded ones, until ``state_dict()`` (``sd``, ``full``: last) reshards them."""
    if I.name == "torch":
        from torch.distributed.checkpoint.state_dict import StateDictOptions
    else:
        from shardwise.checkpoint import StateDictOptions  # type: ignore[no-redef]
    params = dict(model.named_parameters())
    if kind == "param":
        return params
    if kind == "local":
        return {k: p.to_local() if hasattr(p, "device_mesh") else p for k, p in params.items()}
    if kind == "grad":
        return {k: p.grad for k, p in params.items() if p.grad is not None}
    if kind == "optim":
        return {f"{k}.{n}": v for k, st in opt.state_dict()["state"].items() for n, v in st.items()
                if isinstance(v, torch.Tensor) and v.dim() > 0}
    if kind == "sd":
        return model.state_dict()
    return I.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _ops() -> dict[str, Any]:
    from multiprocessing.reduction import ForkingPickler

    def save(c, **kw):
        buf = io.BytesIO()
        torch.save(c, buf)
        buf.seek(0)
        return torch.load(buf, **kw)

    return {  # the ones that move storages (mp, share) last
        "save": lambda c: save(c, weights_only=False),
        "load_safe": lambda c: save(c),
        "pickle": lambda c: pickle.loads(pickle.dumps(c)),
        "deepcopy": copy.deepcopy,
        "dlpack": lambda c: {k: torch.from_dlpack(v) for k, v in c.items()},
        "numpy": lambda c: {k: torch.from_numpy(v.numpy()) for k, v in c.items()},
        "mp": lambda c: ForkingPickler.loads(bytes(ForkingPickler.dumps(c))),
        "share": lambda c: {k: v.share_memory_() for k, v in c.items()},
    }


def _case(op: Any, coll: dict[str, torch.Tensor], name: str) -> str:
    from torch.distributed.tensor import DTensor

    dtensors = [v for v in coll.values() if isinstance(v, DTensor)]
    if dtensors and name in ("share", "dlpack"):
        return "n/a"  # they reach a DTensor's empty wrapper storage (torch: an error, or a crash)
    if any(v.data_ptr() != 0 for v in dtensors):
        # a DTensor over a view at a nonzero storage offset (torch's FSDP2 gradients: views of the
        # reduce-scatter output) is serialized through its empty wrapper storage: an error, or a
        # crash of the process, so not run
        return "invalid"
    try:
        out = op(coll)
        same = out.keys() == coll.keys() and all(torch.equal(_values(out[k]), _values(coll[k])) for k in coll)
    except Exception as e:  # noqa: BLE001  (a case that fails is recorded, as torch's are)
        return f"error:{type(e).__name__}"
    return "ok" if same else "differs"


def _digest(coll: dict[str, torch.Tensor]) -> float:
    return sum(float(_values(v).sum()) * (i + 1) for i, (_, v) in enumerate(sorted(coll.items())))


def _battery(rank: int, world: int, impl_name: str, layout: str, only: tuple[str, str, str] | None = None,
             skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Every state of ``layout`` under ``impl_name`` on one model per state, every operation on
    every kind (storages moved into shared memory included): the cases, the digests, the losses
    and whether ``torch.save(model.state_dict())`` loads back bit-exact. ``only=(state, op,
    kind)`` (``op`` and ``kind`` may be ``"*"``): that alone, as torch's side is recorded ([Note:
    recording torch's side]); ``skip``: the cases (``state/kind.op``) not run, as they crash torch."""
    out: dict[str, Any] = {}
    ops = _ops()
    for state in STATES if only is None else (only[0],):
        model, opt, I = _build(impl_name, layout, rank, world)  # noqa: E741
        losses = [_step(model, opt, rank, 0)]
        if state == "reshard":
            with torch.no_grad():
                model(torch.zeros(1, DIM))
            model.reshard()
        elif state == "unshard":
            model.unshard()
        cases, digests = {}, {}
        for kind in KINDS:  # each kind's operations before the next is taken (the queue and share_memory_ last)
            coll = _collection(kind, model, opt, I)
            digests[kind] = _digest(coll)
            cases.update({f"{kind}.{name}": "crash" if f"{state}/{kind}.{name}" in skip else _case(op, coll, name)
                          for name, op in ops.items()
                          if only is None or (only[1] in ("*", name) and only[2] in ("*", kind))})
        losses += [_step(model, opt, rank, 1), _step(model, opt, rank, 2)]
        out[state] = {"cases": cases, "digests": digests, "losses": losses, "roundtrip": _roundtrip(model)}
    return out


def _roundtrip(model: nn.Module) -> bool:
    """``torch.save(model.state_dict())``, the parameters zeroed, ``load_state_dict(torch.load(...))``:
    the state dict is back bit for bit."""
    before = {k: _values(v).clone() for k, v in model.state_dict().items()}
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if hasattr(p, "device_mesh") else p).zero_()
    buf.seek(0)
    model.load_state_dict(torch.load(buf, weights_only=False))
    after = model.state_dict()
    return after.keys() == before.keys() and all(torch.equal(_values(after[k]), before[k]) for k in before)


def _run(impl_name: str, layout: str, skip: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    return run_on_workers(_battery, LAYOUTS[layout], impl_name, layout, None, skip, timeout=240)


# -- the test -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return read_golden("ordinary_tensors")


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=1e-6)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_case_that_works_on_fsdp2_works_here(layout, golden):
    pytest.importorskip("torchao")
    theirs = golden["layouts"][layout]
    crash = frozenset(f"{st}/{c}" for r in theirs for st, v in r.items() for c, x in v["cases"].items() if x == "crash")
    ours = _run("shardwise", layout, crash)
    for rank, (mine, ref) in enumerate(zip(ours, theirs)):
        for state in STATES:
            m, r = mine[state], ref[state]
            lost = {c: m["cases"][c] for c, v in r["cases"].items() if v == "ok" and m["cases"][c] != "ok"}
            assert not lost, f"{layout}/{state} rank {rank}: ok on torch FSDP2, not here: {lost}"
            invalid = [c for c, v in m["cases"].items() if v == "invalid"]  # beyond FSDP2: its gradients are
            assert not invalid, f"{layout}/{state} rank {rank}: DTensors over views at an offset: {invalid}"
            for kind, d in r["digests"].items():
                assert _close(m["digests"][kind], d), f"{layout}/{state} rank {rank} {kind}: {m['digests'][kind]} vs {d}"
            assert all(_close(a, b) for a, b in zip(m["losses"], r["losses"])), (layout, state, m["losses"], r["losses"])
            assert m["roundtrip"], f"{layout}/{state} rank {rank}: torch.save(model.state_dict()) did not load back bit-exact"


def test_golden_records_the_torch_it_came_from(golden):
    assert golden["torch"] and set(golden["layouts"]) == set(LAYOUTS), "regenerate: python -m tests.compat.regen_goldens ordinary_tensors"
    ok = sum(v == "ok" for lay in golden["layouts"].values() for r in lay for s in r.values() for v in s["cases"].values())
    assert ok > 100, f"the golden has only {ok} cases that work on torch FSDP2: was it recorded against a broken torch?"


# [Note: recording torch's side]
# Some cases kill torch's process (a DTensor over a view at a nonzero offset, a parameter's storage
# moved into shared memory and then freed by a reshard). torch's side runs each state in fresh
# processes (`run_ranks`); a state whose run dies is run again operation by operation, and an
# operation that still dies is recorded as ``crash`` for every kind: shardwise's side does not run
# it (it would end the persistent workers).
def _torch_layout(layout: str) -> list[dict[str, Any]]:
    from tests._dist import RankFailure, run_ranks

    world = LAYOUTS[layout]
    merged: list[dict[str, Any]] = [{} for _ in range(world)]

    def run(state: str, op: str, kind: str) -> None:
        try:
            got = run_ranks(_battery, world, "torch", layout, (state, op, kind), timeout=300)
        except RankFailure:
            if op == "*":
                for name in _ops():
                    run(state, name, "*")
                return
            got = [{state: {"cases": {f"{k}.{op}": "crash" for k in KINDS}}} for _ in range(world)]
        for r, g in enumerate(got):
            into = merged[r].setdefault(state, {"cases": {}})
            into["cases"].update(g[state]["cases"])
            into.update({k: v for k, v in g[state].items() if k != "cases"})

    for state in STATES:
        run(state, "*", "*")
    return merged


@recorder("ordinary_tensors", clients=("torchao",))
def _torch_side(tmp: pathlib.Path) -> dict[str, Any]:
    return {"torch": torch.__version__, "layouts": {lay: _torch_layout(lay) for lay in LAYOUTS}}
