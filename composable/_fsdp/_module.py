"""``FSDPModule``: the methods every module passed to ``fully_shard`` gains, FSDP2's names.

Each method's docstring is its spec; docs/fully_shard.md has the table of FSDP2's public API
with what shardwise does for each entry. Settings are per unit (``recurse=True`` where FSDP2
has it: every unit under the module) and take effect at the next forward / backward / collective,
before or after the first step. Where FSDP2's effect is CUDA-specific (streams, events, memory
pools) the method is accepted and its docstring says what it does elsewhere.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ._param_group import ParamGroup
from ._state import FSDPState, get_state, units_under
from ._unit_inputs import check_reshard_after_forward

__all__ = ["FSDPModule", "UnshardHandle", "share_comm_ctx"]


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``: ``wait()`` finishes the all-gather."""

    def __init__(self, state: FSDPState | None) -> None:
        self._state = state

    def wait(self) -> None:
        if self._state is not None:
            self._state.wait_unshard()
        self._state = None


class FSDPModule:
    """Mixin added to the class of every module passed to ``fully_shard``.

    ``isinstance(m, FSDPModule)`` tells whether ``m`` is the module of a unit. The methods act on
    that unit (and with ``recurse=True`` on every unit below it).
    """

    def _fsdp_state(self) -> FSDPState:
        state = get_state(self)
        if state is None:
            raise RuntimeError(f"{type(self).__name__} has no fully_shard state (a module whose class was changed "
                               "by hand?); call fully_shard on it")
        return state

    def _units(self, recurse: bool) -> list[FSDPState]:
        assert isinstance(self, nn.Module), "FSDPModule is mixed into a module's class"
        return units_under([self]) if recurse else [self._fsdp_state()]

    def _groups(self, recurse: bool = False) -> list[ParamGroup]:
        """The ``ParamGroup`` of this unit (every unit below it with ``recurse``)."""
        return [s.group for s in self._units(recurse) if s.group is not None]

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Any:
        """``nn.Module._apply`` (``to_empty``, ``.to(dtype / device)``, ``.float()``, ...) with
        the unit resharded first and its parameters re-adopted after: the conversion replaces
        the sharded parameters' local tensors, which must become the unit's storage again.
        See [Note: re-adopting parameters] in ``_param_group.py``; a list unit is re-adopted once
        its last module moved ([Note: a unit moved one module at a time] in ``_param_group.py``)."""
        state = self._fsdp_state()
        state.reshard_for_update("module._apply (.to(), to_empty(), .float(), ...)")
        out = super()._apply(fn, recurse)  # type: ignore[misc]
        state.readopt(partial_ok=True)
        return out

    # -- unshard / reshard ------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters now. With ``async_op=True`` return a handle whose
        ``wait()`` finishes it; otherwise return None once done."""
        state = self._fsdp_state()
        state.unshard(async_op=True)
        handle = UnshardHandle(state)
        if not async_op:
            handle.wait()
            return None
        return handle

    def reshard(self) -> None:
        """Free this unit's unsharded parameters and register the sharded ones."""
        self._fsdp_state().reshard()

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward, call it on the root before the next
        step: the step's reductions are waited for and dropped (its gradients, partial HSDP sums
        and accumulated micro-batches are lost: restart the accumulation), every unit is
        resharded and its per-step state cleared. ``RuntimeError`` on a unit that is not the
        root; nothing to do before the first forward. (The next forward also does this by itself
        after a backward that raised: [Note: a backward that raised] in ``_state.py``.)"""
        state = self._fsdp_state()
        if state.ctx is None:
            return
        if not state.is_root:
            raise RuntimeError(f"reset_iter_state: {type(self).__name__} is not the root unit (the module whose "
                               "forward runs first, usually the whole model); call it on the root")
        state.ctx.reset()

    # -- gradient synchronisation -----------------------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, backward keeps accumulating unsharded gradients and issues no
        reduce-scatter (gradient accumulation); set True again before the last micro-batch."""
        for s in self._units(recurse):
            s.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP gradient accumulation: with False, backward reduce-scatters within the shard axis
        and accumulates the sharded sums, but skips the all-reduce across replicas; the next
        backward with True all-reduces the accumulated shards once."""
        for s in self._units(recurse):
            s.requires_all_reduce = requires_all_reduce

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """With False, the end of the next backwards leaves their reductions in flight (they
        overlap the next microbatch) until a backward with True (the default), whose end
        finishes them all; set True before the last backward of a step. Shared by every unit
        of the root. See [Note: backwards that are not the last] in ``_root.py``."""
        state = self._fsdp_state()
        if state.ctx is not None:
            state.ctx.is_last_backward = bool(is_last_backward)
        else:
            state.requested_is_last_backward = bool(is_last_backward)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """With True, a parameter that got no gradient in a backward gets a zero gradient
        instead of keeping ``.grad`` None (FSDP2's switch for ranks whose control flow uses
        different parameters). shardwise's reduction stays collective either way: ranks that
        disagree reduce together and the parameter gets the mean of the gradients that exist
        ([Note: unused parameters] in ``_reduce.py``)."""
        for g in self._groups(recurse):
            g.reduce_scatter_unused_params = bool(reduce_scatter_unused_params)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """This unit's gradients become the sum over the data-parallel ranks divided by
        ``factor`` (default: the data-parallel size, i.e. the mean). ``ValueError`` unless a
        positive number. [Note: dividing and the reduction hook] in ``_reduce.py``."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be a positive number, got {factor!r}")
        for g in self._groups():
            g.comm.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of ``set_gradient_divide_factor`` (as in FSDP2: a DeprecationWarning)."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
                      DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """shardwise's collectives always sum and divide afterwards; with True the reduction
        hook (``set_all_reduce_hook``) sees the sums and the division follows it (default: it
        sees divided gradients, as FSDP2's averaging collectives give)."""
        for g in self._groups():
            g.comm.force_sum = bool(enable)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: object | None = None) -> None:
        """``hook(grads)`` is called, in place, on each of this unit's reduced gradient buckets
        (1-D flat tensor): after the reduce-scatter on a 1-D mesh, after the replica all-reduce
        on a 2-D (HSDP) mesh; e.g. an all-reduce over another group. ``stream``: refused on a
        2-D mesh (``ValueError``, as FSDP2); otherwise the hook runs on the calling thread's
        current stream whatever ``stream`` is (shardwise uses no side streams)."""
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook: hook must be callable, got {type(hook).__name__}")
        for g in self._groups():
            if stream is not None and g.replicate_group is not None:
                raise ValueError("set_all_reduce_hook: stream cannot be set on a 2-D (HSDP) mesh: the hook runs "
                                 "after the replica all-reduce; pass no stream")
            g.comm.all_reduce_hook = hook

    def set_post_optim_event(self, event: object) -> None:
        """The next forward of the root waits for ``event`` (recorded after the optimizer step)
        before its all-gathers, on an accelerator (``event.wait()``), and then drops it: pass a
        new one each step. On CPU the optimizer has finished when forward starts; the event
        is dropped unused."""
        state = self._fsdp_state()
        if state.ctx is not None:
            state.ctx.post_optim_event = event
        else:
            state.requested_post_optim_event = event

    # -- schedule -------------------------------------------------------------------------------------
    def set_unshard_limit(self, limit: int) -> None:
        """At most ``limit`` resharding units unsharded or being all-gathered at once (call on
        the root; default 2). Prefetches that would exceed it are skipped. See
        [Note: the unshard limit] in ``_state.py``."""
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"set_unshard_limit: limit must be an int >= 1, got {limit!r}")
        state = self._fsdp_state()
        if state.ctx is not None and not state.is_root:
            raise ValueError(f"set_unshard_limit: {type(self).__name__} is not the root unit (the module whose "
                             "forward runs first, usually the whole model); call it on the root")
        state.requested_unshard_limit = limit
        if state.ctx is not None:
            state.ctx.unshard_limit = limit

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this unit's backward needs none of its parameters (an embedding, whose gradient
        needs only the indices): backward does not all-gather them (nor prefetch them); its
        gradients are reduced as usual."""
        self._fsdp_state().unshard_in_backward = bool(unshard_in_backward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False keeps the parameters unsharded after backward (until a reshard)."""
        for s in self._units(recurse):
            s.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, *, recurse: bool = True) -> None:
        """As ``fully_shard(reshard_after_forward=...)``; takes effect from the next forward,
        before or after the first step (an int ``k`` makes its subgroup then: collective over
        the ranks of the unit's shard axis)."""
        for s in self._units(recurse):
            value = check_reshard_after_forward(reshard_after_forward, s.mesh)
            s.user_reshard_after_forward = value
            if s.ctx is not None:  # lazy init done: it will not look at this again
                s._setup_post_forward_group()

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """Before this unit's forward, also issue the all-gathers of these units."""
        self._fsdp_state().forward_prefetch = [state_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """Before this unit's backward, also issue the all-gathers of these units."""
        self._fsdp_state().backward_prefetch = [state_of(m, "set_modules_to_backward_prefetch") for m in modules]


    # -- the collectives' settings ----------------------------------------------------------------
    def set_custom_all_gather(self, comm: Any) -> None:
        """This unit's all-gathers use ``comm`` (FSDP2's ``AllGather`` protocol: ``allocate`` and
        ``__call__(output_tensor, input_tensor, group, async_op)``); see [Note: what a custom
        collective sees] in ``_comm.py``. ``TypeError`` if it lacks the two methods."""
        _check_comm(comm, "set_custom_all_gather")
        for g in self._groups():
            g.comm.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """This unit's reduce-scatters use ``comm`` (FSDP2's ``ReduceScatter`` protocol:
        ``allocate`` and ``__call__(output_tensor, input_tensor, group, op, async_op)``, always
        called with ``op=ReduceOp.SUM``). A unit on a 1-rank shard axis issues none."""
        _check_comm(comm, "set_custom_reduce_scatter")
        for g in self._groups():
            g.comm.reduce_scatter_comm = comm

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """True: the reduce-scatters run on a process group of their own over the same shard
        ranks (made now, collective over each shard axis: call it on every rank), so they need
        not queue behind the all-gathers; False: back to the all-gathers' group."""
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for g in self._groups(recurse):
            if not enable or g.world == 1:
                g.comm.reduce_scatter_group = None
                continue
            ranks = tuple(dist.get_process_group_ranks(g.shard_group))
            if ranks not in made:
                made[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
            g.comm.reduce_scatter_group = made[ranks]

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many reduce-scatters (each holding its send buffer) may be in flight at once
        behind the backward (default 1: a unit's reduce-scatter is waited for when the next
        unit issues its own). More overlap, more memory. ``TypeError`` unless an int,
        ``ValueError`` unless >= 1 (as FSDP2)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for g in self._groups(recurse):
            g.comm.max_input_buffers = max_input_buffers

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Recorded; shardwise allocates its collective buffers with ``torch.empty`` (the caching
        allocator) on every backend, so this changes nothing (FSDP2 asks an NCCL process group
        for them). ``ValueError`` with a custom all-gather / reduce-scatter set, as FSDP2."""
        for g in self._groups():
            _check_not_custom(g, "set_allocate_memory_from_process_group_for_comm")
            g.comm.pg_allocate = bool(enable)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Recorded; shardwise's all-gathers do not use symmetric memory, on CUDA or elsewhere,
        so this changes nothing (accepted so FSDP2 code runs). ``ValueError`` for another
        backend than "NCCL" or with a custom all-gather / reduce-scatter set."""
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm: backend must be 'NCCL', got {backend!r}")
        for g in self._groups():
            _check_not_custom(g, "set_symm_mem_for_comm")
            g.comm.symm_mem = backend


def share_comm_ctx(modules: Iterable[nn.Module]) -> None:
    """FSDP2 makes several roots (a pipeline's model chunks) share their CUDA streams. shardwise
    issues every collective on the calling thread's current stream, so roots already share
    them: this checks that every module is a ``fully_shard`` unit (``ValueError`` naming the
    first that is not, as FSDP2) and changes nothing."""
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"share_comm_ctx: expects fully_shard modules (FSDPModule), got {type(m).__name__}; "
                             "call fully_shard on it first")


def state_of(module: nn.Module, where: str) -> FSDPState:
    """The unit state of ``module``; ``ValueError`` naming ``where`` if it is not a unit."""
    s = get_state(module)
    if s is None:
        raise ValueError(f"{where}: {type(module).__name__} is not a fully_shard unit; call fully_shard on it first")
    return s


def _check_comm(comm: Any, where: str) -> None:
    if not (callable(getattr(comm, "allocate", None)) and callable(comm)):
        raise TypeError(f"{where}: {type(comm).__name__} needs an allocate(size, *, dtype, device) method and a "
                        "__call__ (the AllGather / ReduceScatter protocol: shardwise.composable.AllGather, "
                        "shardwise.composable.ReduceScatter)")


def _check_not_custom(g: ParamGroup, where: str) -> None:
    if g.comm.all_gather_comm is not None or g.comm.reduce_scatter_comm is not None:
        raise ValueError(f"{where}: fully_shard({g.label}) has a custom all-gather or reduce-scatter "
                         "(set_custom_all_gather / set_custom_reduce_scatter); it allocates its own buffers")
