"""The ``FSDPModule`` methods that configure a unit's collectives, FSDP2's names: custom
all-gather / reduce-scatter, a separate reduce-scatter group, the reduce-scatters in flight,
and the CUDA-only allocation switches (recorded, no effect). ``FSDPModule`` derives from
`CommMethods`; each docstring is the method's spec (docs/fully_shard.md has the table)."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["CommMethods"]


class CommMethods:
    """Mixin of ``FSDPModule``: the collectives' settings of the unit (``set_custom_*``,
    ``set_separate_reduce_scatter_group``, ``set_reduce_scatter_max_input_buffers``,
    ``set_allocate_memory_from_process_group_for_comm``, ``set_symm_mem_for_comm``)."""

    def _groups(self, recurse: bool = False) -> list:
        """The ``ParamGroup`` of this unit (every unit below it with ``recurse``): ``FSDPModule``'s."""
        raise NotImplementedError

    def set_custom_all_gather(self, comm) -> None:
        """This unit's all-gathers use ``comm`` (FSDP2's ``AllGather`` protocol: ``allocate`` and
        ``__call__(output_tensor, input_tensor, group, async_op)``); see [Note: what a custom
        collective sees] in ``_comm.py``. ``TypeError`` if it lacks the two methods."""
        _check_comm(comm, "set_custom_all_gather")
        for g in self._groups():
            g.comm.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm) -> None:
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


def _check_comm(comm, where: str) -> None:
    if not (callable(getattr(comm, "allocate", None)) and callable(comm)):
        raise TypeError(f"{where}: {type(comm).__name__} needs an allocate(size, *, dtype, device) method and a "
                        "__call__ (the AllGather / ReduceScatter protocol: shardwise.composable.AllGather, "
                        "shardwise.composable.ReduceScatter)")


def _check_not_custom(g, where: str) -> None:
    if g.comm.all_gather_comm is not None or g.comm.reduce_scatter_comm is not None:
        raise ValueError(f"{where}: fully_shard({g.label}) has a custom all-gather or reduce-scatter "
                         "(set_custom_all_gather / set_custom_reduce_scatter); it allocates its own buffers")
