"""`WholeMatrixOptimizer`: an optimizer that needs whole matrices, run on sharded parameters by
one owner per matrix.

[Note: the whole-matrix step]
``step()`` on ranks holding shards of the same parameters:

1. every parameter with a gradient is *active*; each gather group ([Note: the gather group of a
   whole tensor] in ``_pieces.py``) cuts its active tensors, in parameter order, into a few
   buckets of about equal bytes;
2. per bucket one all-to-all sends each rank's pieces of parameter and gradient to the tensor's
   owner ([Note: owners of whole matrices] in ``_owners.py``), all buckets issued at once;
3. the owner assembles each whole parameter and gradient into its *proxy* (a plain tensor
   standing for the parameter in the inner optimizer); the inner ``step()`` runs once over every
   proxy (a step counter counts one), and one all-to-all per bucket sends the updated pieces back;
4. every rank copies its pieces into its shards.

The inner optimizer's state (Muon's momentum) lives only on the owner, keyed by the proxy.
Tensors whose group is one rank are updated in place through a proxy viewing the local tensor.
The inner settings follow ``param_groups`` (a scheduler changes them here) at every step.

``state_dict()`` (collective, as ``load_state_dict``) gives the state a plain optimizer over the
sharded parameters would: state tensors of the parameter's shape as DTensors with its
placements, other values as on every rank. A checkpoint holds no trace of the owners, loads at
any world size, and equals what ``torch.optim.Muon`` on the same sharded model would save.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ._exchange import PendingExchange, Spec, start_exchange
from ._owners import plan_owners
from ._pieces import Pieces, pieces_of
from ._protocol import WHOLE_MATRIX_ATTR, needs_whole_matrices

__all__ = ["WholeMatrixOptimizer"]

_WHERE = "WholeMatrixOptimizer"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _lists(world: int) -> tuple[list[list[torch.Tensor]], list[list[Spec]]]:
    """Empty send and receive lists of an exchange over ``world`` ranks."""
    return [[] for _ in range(world)], [[] for _ in range(world)]


def _placeholder(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``shape`` holding one element (all strides 0): what a proxy holds between steps."""
    return torch.empty_strided(shape, (0,) * len(shape), dtype=like.dtype, device=like.device)


class WholeMatrixOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` (one that needs whole matrices: `needs_whole_matrices`) over ``params``,
    each tensor updated whole by one owner rank ([Note: the whole-matrix step]).

    ``params`` and ``**settings`` are what ``optimizer_class`` takes (parameters or groups, and its
    keyword settings, checked by building it once). ``buckets``: how many collectives per direction
    and gather group a step is cut into, so that transfer overlaps the owners' compute. Build it
    on every rank of the parameters' meshes, from the same parameters in the same order.
    """

    def __init__(self, optimizer_class: type, params: Any, *, buckets: int = 4, **settings: Any) -> None:
        if not needs_whole_matrices(optimizer_class):
            raise TypeError(f"{_WHERE}: {getattr(optimizer_class, '__name__', optimizer_class)!r} does not declare "
                            f"{WHOLE_MATRIX_ATTR} = True (nor is it registered with "
                            "register_whole_matrix_optimizer); an elementwise optimizer runs on the shards directly")
        if buckets < 1:
            raise ValueError(f"{_WHERE}: buckets must be >= 1, got {buckets}")
        self._built = False
        super().__init__(params, {})
        self._built = True
        # the settings and every parameter checked by the optimizer itself, on every rank alike
        probe = optimizer_class([dict(g, params=[_placeholder(_local(p), tuple(p.shape)).requires_grad_()
                                                 for p in g["params"]]) for g in self.param_groups], **settings)
        for g, checked in zip(self.param_groups, probe.param_groups):
            g.update({k: v for k, v in checked.items() if k != "params"})
        self.defaults = dict(probe.defaults)
        del probe
        self._cls, self._settings, self._buckets = optimizer_class, settings, buckets
        self._params: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._group_of: list[int] = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._pieces: list[Pieces] = [pieces_of(p, f"{_WHERE} parameter {i} of shape {list(p.shape)}")
                                      for i, p in enumerate(self._params)]
        # gather groups in order of first appearance (the same on every member), owners per group
        self._keys: dict[tuple, list[int]] = {}
        for i, pc in enumerate(self._pieces):
            self._keys.setdefault(pc.key, []).append(i)
        self._owner: list[int] = [0] * len(self._params)
        for members in self._keys.values():
            plan = plan_owners([self._params[i].numel() for i in members], self._pieces[members[0]].world)
            for i, o in zip(members, plan.owners):
                self._owner[i] = o
        self._mine = [self._owner[i] == self._pieces[i].rank for i in range(len(self._params))]
        self._placeholders: dict[int, torch.Tensor] = {}
        self._proxies: dict[int, torch.Tensor] = {}
        for i, p in enumerate(self._params):
            if self._mine[i]:
                self._placeholders[i] = _placeholder(_local(p), tuple(p.shape))
                self._proxies[i] = self._placeholders[i].detach().requires_grad_(p.requires_grad)
        inner_groups = [dict({k: v for k, v in g.items() if k != "params"},
                             params=[self._proxies[i] for i, gi in enumerate(self._group_of) if gi == g_index
                                     and i in self._proxies])
                        for g_index, g in enumerate(self.param_groups)]
        self.inner: torch.optim.Optimizer = optimizer_class(inner_groups, **settings)
        """The optimizer over this rank's owned tensors (their proxies)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_built", False):
            raise RuntimeError(f"{_WHERE}: add_param_group after construction would move owners and their state; "
                               "build a new WholeMatrixOptimizer with every group instead")
        super().add_param_group(param_group)

    def owner_of(self, p: torch.Tensor) -> int:
        """The rank of ``p``'s gather group that updates it and keeps its state."""
        for i, q in enumerate(self._params):
            if q is p:
                return self._owner[i]
        raise KeyError(f"{_WHERE}.owner_of: the tensor is not one of this optimizer's parameters")

    # -- the step ---------------------------------------------------------------------------

    def _sync_settings(self) -> None:
        for g, inner in zip(self.param_groups, self.inner.param_groups):
            for k, v in g.items():
                if k != "params":
                    inner[k] = v

    def _buckets_of(self, members: list[int]) -> list[list[int]]:
        n = min(self._buckets, len(members))
        total = sum(self._params[i].numel() for i in members)
        out: list[list[int]] = [[]]
        done = 0
        for i in members:
            if out[-1] and len(out) < n and done >= total * len(out) / n:
                out.append([])
            out[-1].append(i)
            done += self._params[i].numel()
        return out

    def _gather(self, bucket: list[int], pc: Pieces, device: torch.device) -> PendingExchange:
        send, recv = _lists(pc.world)
        for i in bucket:
            p = self._params[i]
            grad = p.grad
            assert grad is not None
            send[self._owner[i]] += [_local(p), _local(grad)]
            if self._mine[i]:
                for s in range(pc.world):
                    shape = self._pieces[i].piece_shape(s)
                    recv[s] += [(shape, p.dtype), (shape, grad.dtype)]
        return start_exchange(send, recv, pc.group, device)

    def _scatter(self, bucket: list[int], pc: Pieces, device: torch.device) -> PendingExchange:
        send, recv = _lists(pc.world)
        for i in bucket:
            if self._mine[i]:
                for r in range(pc.world):
                    send[r].append(self._pieces[i].piece(self._proxies[i], r))
            recv[self._owner[i]].append((self._pieces[i].piece_shape(pc.rank), self._params[i].dtype))
        return start_exchange(send, recv, pc.group, device)

    def _release(self, bucket: Iterable[int]) -> None:
        for i in bucket:
            if i in self._proxies:
                self._proxies[i].grad = None
                self._proxies[i].data = self._placeholders[i]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient ([Note: the whole-matrix step])."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_settings()
        active = [i for i, p in enumerate(self._params) if p.grad is not None]
        local = [i for i in active if self._pieces[i].group is None]
        for i in local:  # a group of one: updated in place, in the same inner step
            grad = self._params[i].grad
            assert grad is not None
            self._proxies[i].data = _local(self._params[i])
            self._proxies[i].grad = _local(grad)
        gathers: list[tuple[list[int], Pieces, PendingExchange]] = []
        for members in self._keys.values():
            pc = self._pieces[members[0]]
            todo = [i for i in members if self._params[i].grad is not None]
            if pc.group is None or not todo:
                continue
            device = _local(self._params[todo[0]]).device
            for bucket in self._buckets_of(todo):
                gathers.append((bucket, pc, self._gather(bucket, pc, device)))
        owned: list[int] = list(local)
        for bucket, pc, pending in gathers:  # each assembled as it arrives, while later ones travel
            got = pending.wait()
            k = {s: 0 for s in range(pc.world)}
            for i in bucket:
                if not self._mine[i]:
                    continue
                p, grad = self._params[i], self._params[i].grad
                assert grad is not None
                pieces = [got[s][k[s]] for s in range(pc.world)]
                grads = [got[s][k[s] + 1] for s in range(pc.world)]
                for s in range(pc.world):
                    k[s] += 2
                device = pieces[0].device
                self._proxies[i].data = self._pieces[i].assemble(pieces, torch.empty(p.shape, dtype=p.dtype, device=device))
                self._proxies[i].grad = self._pieces[i].assemble(grads, torch.empty(p.shape, dtype=grad.dtype,
                                                                                    device=device))
                owned.append(i)
        if owned:
            self.inner.step()  # once per step, over every proxy with a gradient
        scatters = [(bucket, self._scatter(bucket, pc, _local(self._params[bucket[0]]).device))
                    for bucket, pc, _ in gathers]
        self._release(owned)
        for bucket, pending in scatters:
            got = pending.wait()
            k = defaultdict(int)
            for i in bucket:
                o = self._owner[i]
                _local(self._params[i]).copy_(got[o][k[o]])
                k[o] += 1
        for i in active:
            self.state[self._params[i]] = {"owner": self._owner[i]}
        return loss

    # -- state dicts --------------------------------------------------------------------------

    def _groups_state(self) -> list[dict[str, Any]]:
        out, start = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            out.append(dict({k: v for k, v in g.items() if k != "params"}, params=list(range(start, start + n))))
            start += n
        return out

    def _has_state(self) -> list[int]:
        return [i for i, p in enumerate(self._params) if self.state.get(p)]

    def state_dict(self) -> dict[str, Any]:
        """The state as a plain optimizer over the sharded parameters would hold it (collective):
        tensors of the parameter's shape as DTensors with its placements, the rest as is."""
        with_state = self._has_state()
        state: dict[int, dict[str, Any]] = {i: {} for i in with_state}
        for members in self._keys.values():
            todo = [i for i in members if i in state]
            if not todo:
                continue
            pc = self._pieces[todo[0]]
            # what each owner holds: name -> a full-shaped tensor's dtype, or the value itself
            meta: dict[int, dict[str, Any]] = {}
            for i in todo:
                if self._mine[i]:
                    meta[i] = {name: ("piece", v.dtype) if isinstance(v, torch.Tensor)
                               and tuple(v.shape) == tuple(self._params[i].shape) and pc.group is not None
                               else ("value", v) for name, v in self.inner.state[self._proxies[i]].items()}
            if pc.group is not None:
                metas: list[Any] = [None] * pc.world
                dist.all_gather_object(metas, meta, group=pc.group)
                for m in metas:
                    meta.update(m)
            send, recv = _lists(pc.world)
            names: list[tuple[int, str]] = []
            for i in todo:
                for name, (kind, v) in sorted(meta[i].items()):
                    if kind == "value":
                        state[i][name] = v.clone() if isinstance(v, torch.Tensor) else v
                        continue
                    if self._mine[i]:
                        full = self.inner.state[self._proxies[i]][name]
                        for r in range(pc.world):
                            send[r].append(self._pieces[i].piece(full, r))
                    recv[self._owner[i]].append((self._pieces[i].piece_shape(pc.rank), v))
                    names.append((i, name))
            if names:
                device = _local(self._params[todo[0]]).device
                got = start_exchange(send, recv, pc.group, device).wait()
                k: dict[int, int] = defaultdict(int)
                for i, name in names:
                    o = self._owner[i]
                    p = self._params[i]
                    assert isinstance(p, DTensor)
                    state[i][name] = DTensor.from_local(got[o][k[o]].clone(), p.device_mesh, p.placements,
                                                        shape=p.shape, stride=p.stride(), run_check=False)
                    k[o] += 1
        for i in with_state:  # a group of one: the state tensors as the parameter's kind of tensor
            if self._pieces[i].group is None:
                p = self._params[i]
                for name, v in list(state[i].items()):
                    if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == p.shape:
                        state[i][name] = DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape,
                                                            stride=p.stride(), run_check=False)
        return {"state": state, "param_groups": self._groups_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Put back a state dict of `state_dict`'s form, from any world size (collective): each
        owner gathers the pieces of its tensors' state."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(h["params"]) for g, h in zip(groups, self.param_groups)):
            raise ValueError(f"{_WHERE}.load_state_dict: the state dict has groups of sizes "
                             f"{[len(g['params']) for g in groups]}, this optimizer "
                             f"{[len(g['params']) for g in self.param_groups]}")
        position = {pos: i for i, pos in enumerate(p for g in groups for p in g["params"])}
        for g, saved in zip(self.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        saved_state = {position[pos]: dict(v) for pos, v in state_dict["state"].items()}
        self.state = defaultdict(dict)
        self.inner.state = defaultdict(dict)
        for members in self._keys.values():
            todo = [i for i in members if i in saved_state]
            if not todo:
                continue
            pc = self._pieces[todo[0]]
            send, recv = _lists(pc.world)
            names: list[tuple[int, str]] = []
            for i in todo:
                p = self._params[i]
                mine: dict[str, Any] = {}
                for name, v in sorted(saved_state[i].items()):
                    if isinstance(v, DTensor):
                        if pc.group is None:
                            mine[name] = v.full_tensor().clone()
                            continue
                        if tuple(v.placements) != tuple(p.placements):  # type: ignore[attr-defined]
                            v = v.redistribute(p.device_mesh, p.placements)  # type: ignore[attr-defined]
                        send[self._owner[i]].append(v.to_local())
                        if self._mine[i]:
                            for s in range(pc.world):
                                recv[s].append((self._pieces[i].piece_shape(s), v.dtype))
                        names.append((i, name))
                    else:
                        mine[name] = v.clone() if isinstance(v, torch.Tensor) else v
                if self._mine[i]:
                    self.inner.state[self._proxies[i]] = mine
                self.state[p] = {"owner": self._owner[i]}
            if names:
                device = _local(self._params[todo[0]]).device
                got = start_exchange(send, recv, pc.group, device).wait()
                k = {s: 0 for s in range(pc.world)}
                for i, name in names:
                    if not self._mine[i]:
                        continue
                    pieces = [got[s][k[s]] for s in range(pc.world)]
                    for s in range(pc.world):
                        k[s] += 1
                    full = torch.empty(self._params[i].shape, dtype=pieces[0].dtype, device=pieces[0].device)
                    self.inner.state[self._proxies[i]][name] = self._pieces[i].assemble(pieces, full)
        # the inner optimizer's own dict orders keys as it would; restore each state's key order
        for i, proxy in self._proxies.items():
            if i in saved_state and proxy in self.inner.state:
                st = self.inner.state[proxy]
                self.inner.state[proxy] = {name: st[name] for name in saved_state[i] if name in st}
