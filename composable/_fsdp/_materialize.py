"""Deferred initialisation of sharded models, and loading from one rank.

[Note: deferred initialisation]
A model built on the meta device and sharded must then get exactly the values its init code
would produce on one device, on every rank and mesh. Random init run on shards cannot (each rank
would draw the stream's first numbers for its own rows), so ``materialize`` runs the init code on
*full-size* tensors, at most one unit's worth at a time:

* every parameter gets a full-size placeholder with empty storage, registered in place of the
  sharded parameter;
* a dispatch mode watches the init code: the first op touching a placeholder makes its unit
  *current*; the previous current unit keeps its own rows and frees its placeholders, the new
  one gets storage (zeros, or its values so far gathered back if the init code returns to it);
* every rank runs the same init code with the same generator state, so the shards equal the
  single-device values bit for bit.

Parameters or meta buffers the init code never touched are an error naming them.

`broadcast_state` (behind ``broadcast_from_rank0``) moves a full state dict from one rank into
the shards through a full-state scatter the caller passes (`FullScatter`, from
``composable/_wrap``): this wing imports no checkpoint code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from .._compat import TorchDispatchMode, storage_key, tree_flatten
from ._param_group import ParamGroup
from ._sharded_param import ShardedParam
from ._override import units_of

__all__ = ["materialize", "broadcast_state", "FullScatter"]


class FullScatter(Protocol):
    """Fill ``state``'s tensors from rank ``src``'s full tensors in ``full``, one at a time;
    ``check()`` runs on ``src`` first and its error is raised on every rank (collective)."""

    def __call__(self, state: dict, full: dict, *, from_rank0: bool, src: int, where: str,
                 check: Callable[[], BaseException | None]) -> None: ...


def _groups(model: nn.Module) -> list[ParamGroup]:
    return [u.group for u in units_of(model) if u.group is not None]


def _refuse_tp(model: nn.Module, what: str) -> None:
    tp = [p.fqn for g in _groups(model) for p in g.params if p.tp_mesh is not None]
    if tp:
        raise NotImplementedError(
            f"{what}: tensor-parallel parameters {tp[:3]}... are not supported yet; initialise or load the model "
            "before applying tensor parallelism, or load a sharded checkpoint (shardwise.checkpoint)."
        )


def _materialize_storage(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Real storage for meta units, meta buffers and meta ignored parameters; returns the
    buffers that were on meta (they need values from the init code)."""
    groups = _groups(model)
    for g in groups:
        if g.sharded_bytes.device.type == "meta":
            g.materialize()
    default = groups[0].compute_device if groups else torch.device("cpu")
    meta_buffers: list[tuple[nn.Module, str]] = []
    device_of = {id(m): u.group.compute_device for u in units_of(model) if u.group is not None for m in u.modules}
    for m in model.modules():
        device = device_of.get(id(m))
        for name, b in list(m._buffers.items()):
            if b is not None and b.device.type == "meta":
                m._buffers[name] = torch.zeros_like(b, device=device or default)
                meta_buffers.append((m, name))
        for name, p in list(m._parameters.items()):
            if p is not None and p.device.type == "meta":
                m._parameters[name] = nn.Parameter(torch.zeros_like(p, device=default), requires_grad=p.requires_grad)
    return meta_buffers


class _Placeholders:
    """Full-size, lazily allocated stand-ins for the parameters of every unit."""

    def __init__(self, groups: list[ParamGroup]) -> None:
        self.groups = groups
        self.full: dict[int, nn.Parameter] = {}  # id(ShardedParam) -> placeholder
        self.owner: dict[int, tuple[ParamGroup, ShardedParam]] = {}  # storage_key -> (group, parameter)
        self.touched: set[int] = set()
        self.ever_active: set[int] = set()
        self.current: ParamGroup | None = None
        for g in groups:
            for p in g.params:
                t = nn.Parameter(torch.empty(p.layout.shape, dtype=p.orig_dtype, device=p.padded.device),
                                 requires_grad=p.requires_grad)
                t.data.untyped_storage().resize_(0)
                self.full[id(p)] = t
                self.owner[storage_key(t)] = (g, p)
                for module, name in p.uses:
                    module._parameters[name] = t

    def touch(self, key: int) -> None:
        g, p = self.owner[key]
        self.touched.add(id(p))
        if self.current is g:
            return
        if self.current is not None:
            self._finalize(self.current)
        self._activate(g)

    def _activate(self, g: ParamGroup) -> None:
        for p in g.params:
            t = self.full[id(p)].data
            t.untyped_storage().resize_(t.numel() * t.element_size())
            t.zero_()
        if id(g) in self.ever_active:  # the init code came back: restore its values so far
            g.gather_original([self.full[id(p)].data for p in g.params])
        self.ever_active.add(id(g))
        self.current = g

    def _finalize(self, g: ParamGroup) -> None:
        for p in g.params:
            t = self.full[id(p)].data
            p.layout.scatter(t, p.padded.view(1, -1), g.rank, g.rank + 1)
            t.untyped_storage().resize_(0)
        self.current = None

    def finish(self) -> None:
        if self.current is not None:
            self._finalize(self.current)
        for g in self.groups:
            for p in g.params:
                p.register(unsharded=False)


class _TouchMode(TorchDispatchMode):
    def __init__(self, placeholders: _Placeholders, buffers: dict[int, str]) -> None:
        super().__init__()
        self.ph = placeholders
        self.buffers = buffers
        self.buffers_touched: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flat, _ = tree_flatten((args, kwargs or {}))
        for t in flat:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                key = storage_key(t)
                if key in self.ph.owner:
                    self.ph.touch(key)
                elif key in self.buffers:
                    self.buffers_touched.add(key)
        return func(*args, **(kwargs or {}))


def _default_init(model: nn.Module) -> None:
    for m in model.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()


def materialize(model: nn.Module, init_fn: Callable[[nn.Module], object] | None = None) -> None:
    """Give a model built on the meta device and sharded with ``fully_shard`` real storage,
    and run ``init_fn(model)`` (default: ``reset_parameters()`` of every submodule that has
    one, in module order) so that every rank's shards hold exactly what the same init would
    put there on one device with the same seed. At most one unit is unsharded at a time.
    See [Note: deferred initialisation]. Collective: call it on every rank.

    Raises ``RuntimeError`` naming the parameters / meta buffers ``init_fn`` left untouched.
    """
    init_fn = _default_init if init_fn is None else init_fn
    _refuse_tp(model, "materialize")
    meta_buffers = _materialize_storage(model)
    groups = _groups(model)
    ph = _Placeholders(groups)
    buffer_keys = {storage_key(b): n for m, n in meta_buffers if (b := m._buffers[n]) is not None}
    mode = _TouchMode(ph, buffer_keys)
    try:
        with torch.no_grad(), mode:
            init_fn(model)
    finally:
        ph.finish()
    missing = [p.fqn for g in groups for p in g.params if id(p) not in ph.touched]
    missing += [f"buffer {n}" for k, n in buffer_keys.items() if k not in mode.buffers_touched]
    if missing:
        raise RuntimeError(
            f"materialize: init_fn did not initialise {missing}; they were built on the meta device and "
            "have no values. Initialise them in init_fn (e.g. a reset_parameters() on their module, or "
            "nn.init.* / .copy_() in your init_weights)."
        )


def _source_problem(model: nn.Module, names: dict[int, str],
                    full_state_dict: dict[str, torch.Tensor] | None) -> Exception | None:
    """On the source rank: what is wrong with its ``full_state_dict`` for ``model``, or None."""
    if full_state_dict is None:
        return ValueError("broadcast_from_rank0: the source rank must pass its full state dict "
                          "(model.state_dict() taken before fully_shard)")
    for g in _groups(model):
        for p in g.params:
            fqn = names[id(p.sharded)]
            if fqn not in full_state_dict:
                return KeyError(f"broadcast_from_rank0: '{fqn}' is missing from the full state dict")
            shape = tuple(full_state_dict[fqn].shape)
            if shape != p.layout.shape:
                return ValueError(f"broadcast_from_rank0: '{fqn}' has shape {shape}, the model expects "
                                  f"{p.layout.shape}")
    return None


def broadcast_state(model: nn.Module, full_state_dict: dict[str, torch.Tensor] | None, src_rank: int,
                    scatter: FullScatter) -> None:
    """``broadcast_from_rank0`` (its docstring, in ``composable/_wrap/_accelerate_config.py``)
    through ``scatter``; no collective of its own."""
    me = dist.get_rank()
    _refuse_tp(model, "broadcast_from_rank0")
    _materialize_storage(model)
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    params: list[ShardedParam] = [p for g in _groups(model) for p in g.params]
    state: dict[str, torch.Tensor] = {names[id(p.sharded)]: p.sharded for p in params}
    state.update(model.named_buffers())
    problem = _source_problem(model, names, full_state_dict) if me == src_rank else None
    full: dict[str, torch.Tensor] = {}
    if me == src_rank and problem is None:
        assert full_state_dict is not None, "checked by _source_problem"
        full = {names[id(p.sharded)]: full_state_dict[names[id(p.sharded)]].detach().to(p.orig_dtype) for p in params}
        full.update((n, b.detach()) for n, b in model.named_buffers())
    # the source's verdict travels with the scatter's own first message: a bad state dict is
    # the same error on every rank, and deferred init issues no collective of its own
    scatter(state, full, from_rank0=True, src=src_rank, where="broadcast_from_rank0's full state dict",
                 check=lambda: problem)
