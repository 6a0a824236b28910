"""Per-unit state and the hooks that drive one training step.

[Note: the life of one training step]
For every unit (one ``fully_shard`` call) the hooks do, in order:

1. forward pre-hook: the first unit to run forward becomes the *root* and lazily collects the
   units under it (``_lazy_init``). The unit waits for (or issues) its all-gather (``unshard``),
   swaps the unsharded tensors onto its modules, then *prefetches* (issues without waiting) the
   all-gather of the unit that ran after it last step (or those set with
   ``set_modules_to_forward_prefetch``). With grad enabled, the tensor inputs pass through
   ``_PostBackward``, whose backward runs once the unit's whole backward is done.
2. forward post-hook: the unit reshards unless ``reshard_after_forward`` is False (the root's
   default), or keeps ``1/k`` for an int ``k``. Under ``torch.no_grad()`` every unit reshards.
   A pre-backward hook is registered on each output that needs grad.
3. pre-backward (first gradient reaching an output): unshard again and prefetch the unit that
   ran before it in forward. The first one queues the root's final callback.
4. post-backward (``_PostBackward.backward``): once every forward call of the unit has seen its
   backward (a reused module reduces once), reshard (before the reduce-scatter's send buffer
   exists), then issue the reduce-scatter asynchronously; issuing moves the earlier reductions a
   stage on ([Note: the reduction pipeline] in ``_reduce.py``).
5. final callback (end of ``loss.backward()``): units whose post-backward could not fire (inputs
   needing no grad, like token ids) reshard and reduce now; all reductions finish; every unit is
   resharded; per-step counters are reset.

[Note: the unshard limit]
The root bounds how many resharding units may be unsharded or being all-gathered at once
(``FSDPModule.set_unshard_limit``, default 2: the one computing and the one prefetched); a
prefetch past the limit is not issued (the unit is all-gathered on demand). Units with
``reshard_after_forward=False`` are not counted.

Activation checkpointing re-runs a unit's forward inside backward; the hooks then neither
reshard nor register backward hooks, but cast inputs and outputs exactly as in the first forward
(``MixedPrecisionPolicy``), so the recomputation reproduces the saved tensors.

[Note: a backward that raised]
An exception inside backward ends ``loss.backward()`` without the root's callback, leaving units
in BACKWARD, some unsharded, with reductions in flight. Skipping such a batch is a normal
pattern, so the next forward that finds the callback pending while no backward runs
(``backward_running``; a recomputation inside backward is left alone) first abandons the broken
step (``RootContext.abandon_step``): reductions waited for and dropped, unsharded gradients
dropped, every unit resharded and set IDLE. What an earlier unit already stored in ``.grad`` is
the user's to clear (``zero_grad``), as with any skipped batch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .._compat import backward_running, run_eagerly, tree_flatten, tree_map, tree_unflatten
from ._common import OWNER_ATTR, TRAINING_NEXT, TraceNames, TrainingState, unit_name
from ._param_group import ParamGroup
from ._policies import MixedPrecisionPolicy
from ._root import DEFAULT_UNSHARD_LIMIT, RootContext
from ._traced import top_is_traced, traced_post_forward, traced_pre_forward

__all__ = ["FSDPState", "get_state", "units_under"]

_STATE_ATTR = "_shardwise_fsdp_state"


def get_state(module: object) -> FSDPState | None:
    """The unit state ``fully_shard`` attached to ``module`` (a module, or ``FSDPModule`` self)."""
    return module.__dict__.get(_STATE_ATTR)


def units_under(modules: Iterable[nn.Module]) -> list[FSDPState]:
    """The units of ``modules`` and of every module below them, each once, in module order."""
    seen, out = set(), []
    for m in modules:
        for sub in m.modules():
            s = get_state(sub)
            if s is not None and id(s) not in seen:
                seen.add(id(s))
                out.append(s)
    return out


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


class _PostBackward(torch.autograd.Function):
    """Identity in forward; in backward, tells the unit that one of its forward calls is done."""

    @staticmethod
    def forward(ctx: Any, state: FSDPState, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.state._post_backward_fired()
        return (None, *grads)


class FSDPState:
    """Hooks and per-step bookkeeping of one unit over ``modules`` (one module, or the list
    given to a single ``fully_shard`` call). ``group`` is None for a unit with no parameters;
    ``ctx`` is the ``RootContext`` shared by every unit under the root, set at lazy init. It is
    also the *handle* other code drives a unit through (``units_of``, ``fully_shard.state``)."""

    def __init__(self, modules: list[nn.Module], group: ParamGroup | None, mesh: Any,
                 reshard_after_forward: bool | int | None, mp: MixedPrecisionPolicy) -> None:
        self.modules = modules
        self.group = group
        self.mesh = mesh
        self.mp = mp
        # configured by the user (one writer each); the effective values are the properties
        # below, which a StepOverride may replace for a step ([Note: step overrides])
        self.user_reshard_after_forward = reshard_after_forward
        self.configured_reshard_after_backward = True
        self.configured_requires_gradient_sync = True
        self.override: Any = None  # a StepOverride, installed by _override.override_unit
        self.requires_all_reduce = True
        self.unshard_in_backward = True  # False: backward needs none of the parameters (an embedding)
        self.requested_is_last_backward: bool | None = None  # set_is_last_backward before lazy init
        self.requested_post_optim_event: object = None  # set_post_optim_event before lazy init
        self.forward_prefetch: list[FSDPState] | None = None  # None: implicit (execution order)
        self.backward_prefetch: list[FSDPState] | None = None
        self.ctx: RootContext | None = None
        self.requested_unshard_limit: int | None = None  # set_unshard_limit before lazy init
        self.training = TrainingState.IDLE
        # per-unit, per-step
        self._post_forward_target: tuple[Any, int] | None = None  # (group, k) for an int reshard_after_forward
        self._forward_seen: set[int] = set()
        self._pending_post_backward = 0
        self._handles: list[Any] = []
        # [Note: hooks under torch.compile] compiling a module makes dynamo trace these hooks,
        # whose storage resizes and parameter swaps must not enter a graph: they run eagerly
        # around the compiled forward, as in FSDP2, unless the whole model is traced ([Note:
        # the traced unit] in _traced.py).
        self._eager_hooks = run_eagerly(self._pre_forward), run_eagerly(self._post_forward)
        self.parent: FSDPState | None = None  # the unit whose fully_shard took this one's modules in
        self.traced_forward = False  # a top unit: its forward is being traced
        self.traced_live, self.traced_seen = False, 0  # the traced path's gathered parameters are on the modules
        for m in modules:
            m.__dict__[_STATE_ATTR] = self
            self._handles.append(m.register_forward_pre_hook(self._pre_hook, prepend=True, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post_hook))

    def _pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if torch.compiler.is_compiling() and top_is_traced(self):
            return traced_pre_forward(self, module, args, kwargs)
        return self._eager_hooks[0](module, args, kwargs)

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        if torch.compiler.is_compiling() and top_is_traced(self):
            return traced_post_forward(self, module, args, output)
        return self._eager_hooks[1](module, args, output)

    @property
    def root(self) -> FSDPState | None:
        """The root unit (None before lazy init)."""
        return None if self.ctx is None else self.ctx.root

    @property
    def is_root(self) -> bool | None:
        return None if self.ctx is None else self.ctx.root is self

    def _effective(self, name: str, configured: Any) -> Any:
        """The value of setting ``name`` for this step: the override's when it sets one (not
        None), else ``configured`` ([Note: step overrides])."""
        value = None if self.override is None else getattr(self.override, name)
        return configured if value is None else value

    @property
    def reshard_after_forward(self) -> bool | int:
        return self._effective("reshard_after_forward", self.configured_reshard_after_forward())

    @property
    def reshard_after_backward(self) -> bool:
        return self._effective("reshard_after_backward", self.configured_reshard_after_backward)

    @reshard_after_backward.setter
    def reshard_after_backward(self, value: bool) -> None:
        self.configured_reshard_after_backward = value

    @property
    def requires_gradient_sync(self) -> bool:
        return self._effective("requires_gradient_sync", self.configured_requires_gradient_sync)

    @requires_gradient_sync.setter
    def requires_gradient_sync(self, value: bool) -> None:
        self.configured_requires_gradient_sync = value

    def configured_reshard_after_forward(self) -> bool | int:
        """``reshard_after_forward`` as the user set it, or its default (True, but False on the
        root once lazy init has found it)."""
        if self.user_reshard_after_forward is not None:
            return self.user_reshard_after_forward
        return not self.is_root if self.ctx is not None else True

    def _set_training(self, new: TrainingState) -> None:
        if new not in TRAINING_NEXT[self.training]:
            label = self.group.label if self.group is not None else type(self.modules[0]).__name__
            raise AssertionError(f"fully_shard({label}): training state {self.training.name} -> {new.name}")
        self.training = new

    # -- the handle: what other code drives the unit through ------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Issue the all-gather of the unit's parameters (a no-op if gathered or in flight);
        wait for it unless ``async_op``."""
        if self.group is not None:
            self.group.unshard(async_op=async_op)

    def wait_unshard(self) -> None:
        """Finish an issued all-gather: the modules hold the unsharded parameters."""
        if self.group is not None:
            self.group.wait_unshard()

    def reshard(self) -> None:
        """Free the unsharded parameters; the modules hold the sharded ones."""
        if self.group is not None:
            self.group.reshard()

    def finish_backward(self) -> None:
        """The root's end of backward for every unit under this unit's root (what runs after
        ``loss.backward()``): gradients reduced and stored, units resharded, per-step state
        reset. Nothing before lazy init."""
        if self.ctx is not None:
            self.ctx.final_callback()

    def abandon_step(self) -> None:
        """Drop the step of every unit under this unit's root, as after a backward that raised
        ([Note: a backward that raised]). Nothing before lazy init."""
        if self.ctx is not None:
            self.ctx.abandon_step()

    def reshard_for_update(self, what: str) -> None:
        """Reshard the unit before ``what`` replaces or reads its parameters (between steps only)."""
        g = self.group
        if g is None or not (g.is_unsharded or g.unshard_pending):
            return
        if self.training is TrainingState.BACKWARD:
            raise RuntimeError(f"fully_shard({g.label}): {what} during backward; call it between steps")
        g.reshard()

    def readopt(self, partial_ok: bool = False) -> None:
        """Re-adopt the parameters the unit's modules hold now ([Note: re-adopting parameters]
        in ``_param_group.py``); ``partial_ok`` after one of its modules moved ([Note: a unit
        moved one module at a time] in ``_param_group.py``)."""
        if self.group is None:
            return
        self.group.readopt(partial_ok and len(self.modules) > 1)  # one module moves all its parameters at once
        for sp in self.group.params:  # swap_tensors swaps __dict__ too: put the mark back
            if getattr(sp.sharded, OWNER_ATTR, None) is None:
                setattr(sp.sharded, OWNER_ATTR, sp.owner)

    # -- lazy init ------------------------------------------------------------------------------
    def _lazy_init(self) -> RootContext:
        if self.ctx is not None:
            return self.ctx
        states = units_under(self.modules)
        limits = [s for s in states if s is not self and s.requested_unshard_limit is not None]
        if limits:
            raise ValueError(
                f"set_unshard_limit was called on {len(limits)} unit(s) that are not the root (the root is the "
                "module whose forward runs first, usually the whole model); call it on the root")
        for s in states:  # before anything is set up: an error here leaves lazy init to run again
            if s.group is not None:
                s.group.adopt_replaced()
        ctx = RootContext(self, states, self.requested_unshard_limit or DEFAULT_UNSHARD_LIMIT)
        if self.requested_is_last_backward is not None:
            ctx.is_last_backward = self.requested_is_last_backward
        ctx.post_optim_event, self.requested_post_optim_event = self.requested_post_optim_event, None
        paths: dict[int, str] = {}
        for top in self.modules:
            for path, m in top.named_modules():
                paths.setdefault(id(m), path)
        for s in states:
            s.ctx = ctx
            if s.group is not None:
                s.group.trace = TraceNames.for_unit(unit_name(s.modules, paths))
        for s in states:
            s._setup_post_forward_group()
        return ctx

    def _setup_post_forward_group(self) -> None:
        """The subgroup an int ``reshard_after_forward`` reshards onto (none for a bool).
        Called at lazy init and by ``set_reshard_after_forward`` after it (setters take effect
        whenever they are called); subgroups are made once per rank set, kept by the root."""
        k = self.configured_reshard_after_forward()
        self._post_forward_target = None
        if self.group is None or isinstance(k, bool):
            return
        g = self.group
        shard_ranks = dist.get_process_group_ranks(g.shard_group)
        start = (g.rank // k) * k
        assert self.ctx is not None, "called at or after lazy init"
        self._post_forward_target = (self.ctx.subgroup(tuple(shard_ranks[start : start + k])), k)

    # -- prefetch (see [Note: the unshard limit]) -------------------------------------------------
    def _prefetch(self, states: list[FSDPState], backward: bool = False) -> None:
        ctx = self.ctx
        assert ctx is not None, "prefetches run after lazy init"
        for s in states:
            g = s.group
            if g is None or g.is_unsharded or g.unshard_pending or (backward and not s.unshard_in_backward):
                continue
            if s.reshard_after_forward is not False and ctx.busy_units() >= ctx.unshard_limit:
                continue
            g.unshard(async_op=True)

    def _neighbour(self, step: int) -> list[FSDPState]:
        assert self.ctx is not None, "after lazy init"
        order = self.ctx.order
        if self not in order:
            return []
        i = order.index(self) + step
        return [order[i]] if 0 <= i < len(order) else []

    # -- forward ----------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        ctx = self._lazy_init()
        if ctx.callback_queued and not backward_running():  # [Note: a backward that raised]
            ctx.abandon_step()
        if self.training is TrainingState.BACKWARD:  # recomputation under activation checkpointing
            return self._cast_inputs(args, kwargs)  # casts as the first forward, nothing else
        self._set_training(TrainingState.FORWARD)
        if self is ctx.root and not self._forward_seen:
            ctx.this_order, ctx.thread = [], threading.get_ident()
            event, ctx.post_optim_event = ctx.post_optim_event, None
            if event is not None and self.group is not None and self.group.compute_device.type != "cpu":
                event.wait()  # type: ignore[attr-defined]  # set_post_optim_event: the all-gathers follow it
            if not ctx.callback_queued:  # a new step: forget forwards that saw no backward
                for s in ctx.states:
                    s._pending_post_backward = 0
        if self not in ctx.this_order:
            ctx.this_order.append(self)
        self._forward_seen.add(id(module))
        self.unshard()
        self._prefetch(self.forward_prefetch if self.forward_prefetch is not None else self._neighbour(+1))
        args, kwargs = self._cast_inputs(args, kwargs)
        if torch.is_grad_enabled():
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def _cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            return _cast_floats((args, kwargs), self.mp.param_dtype)
        return args, kwargs

    def _cast_output(self, output: Any) -> Any:
        return output if self.mp.output_dtype is None else _cast_floats(output, self.mp.output_dtype)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.training is TrainingState.BACKWARD:  # recomputation: the same output casts
            return self._cast_output(output)
        if self.group is not None and len(self._forward_seen) == len(self.modules):
            if not torch.is_grad_enabled() or self.reshard_after_forward is True:
                self.group.reshard()
            elif self._post_forward_target is not None and self.reshard_after_forward is not False:
                self.group.reshard(to=self._post_forward_target)
        if len(self._forward_seen) == len(self.modules):  # the last of its modules is done
            self._forward_seen.clear()
            self._set_training(TrainingState.IDLE)
        output = self._cast_output(output)
        if torch.is_grad_enabled():
            flat, _ = tree_flatten(output)
            for t in flat:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        return output

    # -- backward: steps 3 to 5 of [Note: the life of one training step] --------------------------
    def _register_post_backward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return args, kwargs
        outs = _PostBackward.apply(self, *[flat[i] for i in idx])
        for i, t in zip(idx, outs):
            flat[i] = t
        self._pending_post_backward += 1
        return tree_unflatten(flat, spec)

    def _pre_backward(self, grad: torch.Tensor) -> None:
        assert self.ctx is not None, "a backward runs after lazy init"
        self.ctx.start_backward()
        self._set_training(TrainingState.BACKWARD)
        if self.unshard_in_backward:
            self.unshard()
        self._prefetch(self.backward_prefetch if self.backward_prefetch is not None else self._neighbour(-1),
                       backward=True)

    def _post_backward_fired(self) -> None:
        self._pending_post_backward -= 1
        if self._pending_post_backward <= 0:
            self._pending_post_backward = 0
            # free the unsharded parameters before the reduce-scatter allocates its send buffer
            if self.reshard_after_backward:
                self.reshard()
            self.reduce()

    def reduce(self) -> None:
        """Issue the reduction of the unit's unsharded gradients (kept in flight by the root),
        or, with ``requires_gradient_sync`` False, keep accumulating them unsharded."""
        if self.group is None:
            return
        if not self.requires_gradient_sync:
            self.group.stash_unsharded_grads()
            return
        assert self.ctx is not None, "a backward runs after lazy init"
        issued = self.group.reduce_grads(all_reduce=self.requires_all_reduce,
                                         replica_buckets=self.ctx.replica_buckets)
        if issued:
            self.ctx.keep_in_flight(issued)

    def end_step(self) -> None:
        """Called by the root's end-of-backward callback on every unit: resharded (unless
        ``reshard_after_backward=False``), per-step state reset."""
        self._pending_post_backward = 0
        self._forward_seen.clear()
        self.training = TrainingState.IDLE  # from any state: the step is over
        if self.group is not None:
            self.group.wait_unshard()
            if self.reshard_after_backward:
                self.group.reshard()
            self.group.drop_post_forward()
