"""How a pipeline step drives the ``fully_shard`` units of this rank's stages.

[Note: fully_shard units in a pipeline step]
A stage runs ``m`` forwards and ``m`` backwards per step; a unit left to FSDP's own rules would
all-gather its parameters in each of them and could reduce in each backward. `StageUnits`
changes three settings of every unit for the duration of one step, and puts them back after it:

* ``requires_gradient_sync``: False in every backward of a stage but its last, so gradients
  accumulate unsharded and each unit issues one reduce-scatter per step (one replica
  all-reduce with HSDP). With ``reduce_every_microbatch`` every backward reduces. A unit the
  user set to False before the step (accumulation over several steps, as with FSDP2) reduces
  in none of them.
* ``reshard_after_backward``: False in every backward of a stage but its last (as torch's own
  schedules do with FSDP2): the next microbatch's forward and backward find the parameters
  gathered.
* ``reshard_after_forward``: False during the step for units that left it at its default
  (torchtitan's choice with a pipeline: a per-microbatch all-gather cannot hide behind one
  microbatch's compute). An explicit value is obeyed.

So by default a unit gathers once per step, and a stage holds its parameters gathered from its
first forward to its last backward, as ``SHARD_GRAD_OP`` (ZeRO-2) does; the memory planner
plans that ([Note: the memory of a pipeline stage]). ``reshard_between_microbatches=True``
leaves FSDP's resharding alone (``2 m`` all-gathers per unit per step, FSDP's memory).

A step that fails must not leave parameters gathered (the modules would hold plain tensors
instead of their shards: a checkpoint or an optimizer built then would see full tensors) nor
the failed step's partial gradients in the units (the next step would add them in): `abandon`
restores the settings, then every unit's root abandons the step as after a backward that
raised ([Note: a backward that raised] in ``_state.py``).
"""

from __future__ import annotations

import torch.nn as nn

from .._fsdp import FSDPModule

__all__ = ["StageUnits"]


def _units_of(module: nn.Module) -> list:
    """The ``fully_shard`` unit states in ``module`` (each once)."""
    out = []
    for m in module.modules():
        if isinstance(m, FSDPModule):
            s = m._fsdp_state()
            if all(s is not o for o in out):
                out.append(s)
    return out


class StageUnits:
    """The units of this rank's stages for one step; see [Note: fully_shard units in a pipeline step].

    ``stages``: stage index -> module; ``keep``: keep parameters gathered between microbatches;
    ``every_microbatch``: reduce after every backward."""

    def __init__(self, stages: dict, keep: bool, every_microbatch: bool) -> None:
        self.units = {i: _units_of(m) for i, m in stages.items()}
        self.every_microbatch = every_microbatch
        self.keep = keep
        self.user = {id(u): (u.reshard_after_backward, u.requires_gradient_sync)
                     for us in self.units.values() for u in us}
        if keep:
            for u in self._all():
                if u.user_reshard_after_forward is None:
                    u.reshard_after_forward = False

    def _all(self):
        return [u for us in self.units.values() for u in us]

    def before_backward(self, stage: int, last: bool) -> None:
        """Set the units of ``stage`` for its next backward (``last``: its last in the step)."""
        for s in self.units[stage]:
            rab, sync = self.user[id(s)]
            s.requires_gradient_sync = sync and (last or self.every_microbatch)
            s.reshard_after_backward = rab if last or not self.keep else False

    def restore(self) -> None:
        """Put every setting back as it was before the step."""
        for u in self._all():
            u.reshard_after_backward, u.requires_gradient_sync = self.user[id(u)]
            # as configured, not the value saved before the step: lazy init in the first step
            # changes the root's
            u.reshard_after_forward = u.configured_reshard_after_forward()

    def abandon(self) -> None:
        """After a failed step: settings back, parameters resharded, partial gradients dropped."""
        self.restore()
        done = []
        for u in self._all():
            if u.ctx is not None and all(u.ctx is not c for c in done):
                done.append(u.ctx)
                u.ctx.abandon_step()
