"""How another wing changes a unit's per-step behaviour without writing its fields.

[Note: step overrides]
A unit's settings have one writer each: the user (``fully_shard(...)``, the ``set_*`` setters)
sets the *configured* values, and lazy init derives the root's default from them. A schedule
driving units through several forwards and backwards in one step (the pipeline: [Note:
fully_shard units in a pipeline step]) changes some for that step only, through a frozen
`StepOverride` installed with `override_unit` (a None field keeps the configured value) and
removed by `clear_override`, leaving the user's settings exactly as they were:

    unit = units_of(stage_module)[0]
    override_unit(unit, StepOverride(reshard_after_forward=False))
    ...                                     # forwards and backwards of the step
    clear_override(unit)

The unit's effective values (``FSDPState.reshard_after_forward`` ...) read through the override;
`configured` gives the configured ones. Other wings hold a unit as a `UnitHandle` (the few
members they use), never the whole state.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Protocol

import torch.nn as nn

from ._param_group import ParamGroup
from ._state import units_under

__all__ = ["StepOverride", "override_unit", "clear_override", "units_of", "configured"]


@dataclass(frozen=True)
class StepOverride:
    """Per-step values of a unit's settings; None keeps the configured value."""

    reshard_after_forward: bool | int | None = None
    reshard_after_backward: bool | None = None
    requires_gradient_sync: bool | None = None

    def merged(self, other: "StepOverride") -> "StepOverride":
        """This override with ``other``'s set fields on top."""
        return replace(self, **{f.name: getattr(other, f.name) for f in fields(other)
                                if getattr(other, f.name) is not None})


class UnitHandle(Protocol):
    """A ``fully_shard`` unit as other wings (the pipeline's step) and deferred init drive it:
    its step override and configured settings, its parameters' all-gather, its root's end of
    backward or abandoned step, and (deferred init) its modules and parameter group."""

    override: StepOverride | None
    user_reshard_after_forward: bool | int | None
    configured_reshard_after_backward: bool
    configured_requires_gradient_sync: bool
    group: ParamGroup | None
    modules: list[nn.Module]

    @property
    def root(self) -> object | None: ...

    def configured_reshard_after_forward(self) -> bool | int: ...

    def unshard(self, async_op: bool = False) -> None: ...

    def finish_backward(self) -> None: ...

    def abandon_step(self) -> None: ...


def override_unit(state: UnitHandle, override: StepOverride) -> None:
    """Install ``override`` on the unit ``state``, on top of any installed."""
    state.override = override if state.override is None else state.override.merged(override)


def clear_override(state: UnitHandle) -> None:
    """Back to the configured settings."""
    state.override = None


def configured(state: UnitHandle) -> StepOverride:
    """The unit's configured settings (what the user set, the root default applied)."""
    return StepOverride(state.configured_reshard_after_forward(), state.configured_reshard_after_backward,
                        state.configured_requires_gradient_sync)


def units_of(module: nn.Module) -> list[UnitHandle]:
    """The ``fully_shard`` units of ``module`` and of every module below it, each once, in
    module order."""
    return list(units_under([module]))
