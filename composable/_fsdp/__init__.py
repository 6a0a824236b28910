"""The fully_shard wing: FSDP / ZeRO-3 on a 1-D mesh, HSDP on a 2-D replicate x shard mesh.

One file per concept (see docs/architecture.md): the shard layout (``_layout.py``), one
parameter (``_sharded_param.py``; a tensor-parallel one's layout in ``_tp_param.py``), one
unit's flat buffers and collectives (``_param_group.py``; where its parameters are,
``ShardState``, in ``_shard_state.py``), gradient reduction (``_reduce.py``), per-unit hooks
(``_state.py``; the backward ones in ``_backward.py``, the unit's ``TrainingState`` in
``_training_state.py``), the collectives' protocols and options (``_comm.py``), the
``FSDPModule`` methods (``_module.py``; its collectives' setters in ``_comm_methods.py``),
parameters replaced from outside (``_adopt.py``), one call's inputs (``_unit_inputs.py``), the
``FSDP<cls>`` class (``_fsdp_class.py``), root-only state (``_root.py``), deferred init
(``_materialize.py``), the API (``_fully_shard.py``) and the error FSDP2 raises as
``AssertionError`` (``_errors.py``). This wing imports only the shared leaves of
``composable`` (``_compat``, ``_mesh_utils``, ``_chunks``); the other wings use it through the
names below.
"""

from ._comm import AllGather, ReduceScatter
from ._fully_shard import (FSDPModule, FullyShardUsageError, UnshardHandle, fully_shard, register_fsdp_forward_method,
                           share_comm_ctx)
from ._layout import make_layout  # for the planner (_plan)
from ._materialize import broadcast_from_rank0, materialize
from ._override import StepOverride, clear_override, configured, override_unit, units_of
from ._policies import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "FullyShardUsageError",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "AllGather",
    "ReduceScatter",
    "materialize",
    "broadcast_from_rank0",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    # the interface other wings drive units through ([Note: step overrides])
    "StepOverride",
    "override_unit",
    "clear_override",
    "configured",
    "units_of",
]
