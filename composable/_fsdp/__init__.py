"""The fully_shard wing: FSDP / ZeRO-3 on a 1-D mesh, HSDP on a 2-D replicate x shard mesh.

One file per concept (see docs/architecture.md): the shard layout (``_layout.py``), one
parameter (``_sharded_param.py``; a tensor-parallel one's layout in ``_tp_param.py``), one
unit's flat buffers and collectives (``_param_group.py``), gradient reduction (``_reduce.py``)
and the replica buckets of NO_SHARD (``_bucket.py``), the per-unit hooks and handle
(``_state.py``), root-only state (``_root.py``), the collectives' protocols and options
(``_comm.py``), the ``FSDPModule`` methods (``_module.py``), one call's inputs
(``_unit_inputs.py``), the whole-SPMD-mesh form (``_spmd.py``), the ``FSDP<cls>`` class
(``_fsdp_class.py``) and its ``save_pretrained`` (``_hf_save.py``), step overrides
(``_override.py``), deferred init (``_materialize.py``), the API (``_fully_shard.py``), and the
small shared pieces: the error, the two state machines, the trace names (``_common.py``).
This wing imports only the shared leaves of ``composable`` (``_compat``, ``_mesh_utils``,
``_chunks``) and ``shardwise.mesh`` (no checkpoint code: the full-state scatter is passed in,
`broadcast_state`); the other wings use it through the names below.

Other wings drive a unit through `UnitHandle` (what `units_of` returns; `FSDPState`
implements it): its step override and settings, ``unshard``, ``finish_backward`` /
``abandon_step``.
"""

from ._comm import AllGather, ReduceScatter
from ._fully_shard import (FSDPModule, FullyShardUsageError, UnshardHandle, fully_shard, register_fsdp_forward_method,
                           share_comm_ctx)
from ._layout import make_layout
from ._materialize import FullScatter, broadcast_state, materialize
from ._override import StepOverride, UnitHandle, clear_override, configured, override_unit, units_of
from ._policies import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from ._state import FSDPState

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
    "broadcast_state",
    "FullScatter",
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
    "UnitHandle",
    "FSDPState",  # the unit handle
    "make_layout",  # the shard layout of one parameter, for the planner
]
