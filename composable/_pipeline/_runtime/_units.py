"""How a pipeline step drives the ``fully_shard`` units of this rank's stages.

[Note: fully_shard units in a pipeline step]
A stage runs ``m`` forwards and ``m`` backwards per step; a unit left to FSDP's own rules would
all-gather its parameters in each of them and could reduce in each backward. `StageUnits`
overrides three settings of every unit for the duration of one step, through the fully_shard
wing's step overrides ([Note: step overrides] in ``_fsdp/_override.py``; the user's settings
are never written):

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

A split backward ([Note: split backward] in ``_pipeline/_split/_split_backward.py``) treats ``I`` as a backward
that neither reduces nor reshards (its gradients reach no parameter) and ``W`` as the stage's
backward for these rules: the reduce-scatter is issued after the stage's last ``W``, one per unit
per step. ``W`` runs outside the units' autograd hooks (nothing of it passes their inputs or
outputs), so `after_weight_grad` does what their end of backward does: reduce (or keep) the
gradients and finish the reductions; a unit resharded since ``I`` is gathered again first.

A step that fails must not leave parameters gathered (the modules would hold plain tensors
instead of their shards: a checkpoint or an optimizer built then would see full tensors) nor
the failed step's partial gradients in the units (the next step would add them in): `abandon`
restores the settings, then every unit's root abandons the step as after a backward that
raised ([Note: a backward that raised] in ``_fsdp/_state.py``).
"""

from __future__ import annotations

import torch.nn as nn

from ..._fsdp import StepOverride, UnitHandle, clear_override, override_unit, units_of

__all__ = ["StageUnits"]


class StageUnits:
    """The units of this rank's stages for one step; see [Note: fully_shard units in a pipeline step].

    ``stages``: stage index -> module; ``keep``: keep parameters gathered between microbatches;
    ``every_microbatch``: reduce after every backward. The units' settings are changed only
    through step overrides ([Note: step overrides] in ``_fsdp/_override.py``): the user's
    stay as they were."""

    def __init__(self, stages: dict[int, nn.Module], keep: bool, every_microbatch: bool) -> None:
        self.units = {i: units_of(m) for i, m in stages.items()}
        self.every_microbatch = every_microbatch
        self.keep = keep
        for u in self._all():
            # a unit that left reshard_after_forward at its default keeps its parameters
            # gathered for the step; an explicit value is obeyed
            keep_gathered = keep and u.user_reshard_after_forward is None
            override_unit(u, StepOverride(reshard_after_forward=False if keep_gathered else None))

    def _all(self) -> list[UnitHandle]:
        seen: list[UnitHandle] = []
        for us in self.units.values():
            seen += [u for u in us if all(u is not o for o in seen)]
        return seen

    def before_backward(self, stage: int, last: bool) -> None:
        """Set the units of ``stage`` for its next backward (``last``: its last in the step)."""
        for s in self.units[stage]:
            sync = s.configured_requires_gradient_sync and (last or self.every_microbatch)
            keep = not last and self.keep
            override_unit(s, StepOverride(requires_gradient_sync=sync, reshard_after_backward=False if keep else
                                          s.configured_reshard_after_backward))

    def before_input_grad(self, stage: int) -> None:
        """Set the units of ``stage`` for an ``I``: no reduction, parameters kept for its ``W``."""
        for s in self.units[stage]:
            override_unit(s, StepOverride(requires_gradient_sync=False, reshard_after_backward=False))

    def before_weight_grad(self, stage: int, last: bool) -> None:
        """Set the units of ``stage`` for a ``W`` (``last``: its last in the step); a unit
        resharded since the ``I`` is gathered again (into the same storage its graph saved)."""
        self.before_backward(stage, last)
        for s in self.units[stage]:
            s.unshard()

    def after_weight_grad(self, stage: int) -> None:
        """The units' end of backward after a ``W``: reduce (or keep) the gradients it made."""
        done: list[object] = []
        for u in self.units[stage]:
            if u.root is not None and all(u.root is not r for r in done):
                done.append(u.root)
                u.finish_backward()

    def restore(self) -> None:
        """The units' own settings again (the overrides dropped)."""
        for u in self._all():
            clear_override(u)

    def abandon(self) -> None:
        """After a failed step: settings back, parameters resharded, partial gradients dropped."""
        self.restore()
        done: list[object] = []
        for u in self._all():
            if u.root is not None and all(u.root is not r for r in done):
                done.append(u.root)
                u.abandon_step()
