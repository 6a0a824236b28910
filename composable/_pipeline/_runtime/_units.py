"""How a pipeline step drives the ``fully_shard`` units of this rank's stages.

[Note: fully_shard units in a pipeline step]
`StageUnits` overrides three settings of every unit for one step, through step overrides ([Note:
step overrides] in ``_fsdp/_override.py``; the user's settings are never written):
``requires_gradient_sync`` and ``reshard_after_backward`` are False in every backward of a stage
but its last (each unit issues one reduce-scatter per step; with ``reduce_every_microbatch`` every
backward reduces; a unit the user set to no sync reduces in none), and ``reshard_after_forward``
is False during the step for units left at its default (torchtitan's choice; an explicit value is
obeyed). So by default a unit gathers once per step and holds its parameters from its first
forward to its last backward, as ZeRO-2 does, which the planner plans ([Note: the memory of a
pipeline stage]); ``reshard_between_microbatches=True`` leaves FSDP's resharding alone.

A split backward ([Note: split backward] in ``_pipeline/_split/_split_backward.py``): ``I``
neither reduces nor reshards, ``W`` counts as the stage's backward. ``W`` runs outside the units'
autograd hooks, so `after_weight_grad` does their end of backward (a unit resharded since ``I`` is
gathered again first). A failed step must leave neither gathered parameters nor partial gradients:
`abandon` restores the settings, then every unit's root abandons the step ([Note: a backward that
raised] in ``_fsdp/_state.py``).
"""

from __future__ import annotations

import torch.nn as nn

from ..._fsdp import StepOverride, UnitHandle, clear_override, override_unit, units_of

__all__ = ["StageUnits"]


class StageUnits:
    """The units of this rank's stages (stage -> module) for one step ([Note: fully_shard units in
    a pipeline step]); ``keep``: gathered between microbatches; ``every_microbatch``: reduce after
    every backward."""

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
