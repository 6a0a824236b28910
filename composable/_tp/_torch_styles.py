"""Plans that name torch's style classes: each entry runs as the shardwise style of the same name.

[Note: torch's style objects in a plan]
Code written for torch's tensor parallelism builds plans from torch's style classes or
subclasses of them (torchao's float8 training passes ``Float8ColwiseParallel`` /
``Float8RowwiseParallel``, which override the two forward hooks to cast to float8). With only its
imports changed, such code hands those objects to shardwise's `parallelize_module`.

`adopt` turns each into the shardwise style of the same name, built from the arguments the
object keeps (``_compat.torch_style_fields``); torch's implementation never runs. A subclass's
own code runs as torch runs it:

* its forward hooks (``_prepare_*_fn``) as the module's forward pre-hook and hook
  (`TorchHooks`), called with the style's layouts, the module, its inputs or output, and the mesh;
* its ``_apply`` (`TorchApply`), with the shardwise style standing in for torch's base class
  (``_compat.run_apply_override``), when the plan is applied, after every entry was validated.

Any other override is refused in one line naming the shardwise style to use instead. The same
hooks and ``_apply`` on a subclass of shardwise's styles run the same way
(`ModuleParallel.apply`): torchao's classes when torch's names were rebound before its import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ._compat import (TORCH_HOOKS, run_apply_override, torch_style_class, torch_style_fields, torch_style_kind,
                      torch_style_overrides)
from ._prepare import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput
from ._sequence import SequenceParallel
from ._styles import ApplyContext, ColwiseParallel, ModuleParallel, ParallelStyle, RowwiseParallel, check_torch_hooks

__all__ = ["adopt", "TorchApply", "TorchHooks"]


@dataclass(frozen=True)
class TorchHooks(ParallelStyle):
    """A torch ``ColwiseParallel`` / ``RowwiseParallel`` subclass: the parameters go as
    ``style`` (the shardwise style of the same name) puts them, the subclass's overridden hooks
    replace ``style``'s ([Note: torch's style objects in a plan])."""

    style: ModuleParallel
    input_layouts: tuple
    output_layouts: tuple
    use_local_output: bool
    input_fn: Callable | None = None
    output_fn: Callable | None = None

    def validate(self, module: nn.Module, ctx: ApplyContext) -> None:
        self.style.validate(module, ctx)
        check_torch_hooks((self.input_fn, self.output_fn), self.style._rule(module, ctx), ctx.where(self.style, module))

    def apply(self, module: nn.Module, mesh: DeviceMesh, ctx: ApplyContext) -> None:
        self.style.install_torch_hooks(module, mesh, ctx, self.input_fn, self.output_fn, self.input_layouts,
                                       self.output_layouts, self.use_local_output)


@dataclass(frozen=True)
class TorchApply(ParallelStyle):
    """A torch style subclass that overrides ``_apply``: the override runs with ``style`` (the
    shardwise style adopted from it) standing in for torch's class ``kind``
    ([Note: torch's style objects in a plan])."""

    style: ParallelStyle
    torch_style: object
    kind: str

    @property
    def shards_parameters(self) -> bool:  # type: ignore[override]
        return self.style.shards_parameters

    def validate(self, module: nn.Module, ctx: ApplyContext) -> None:
        self.style.validate(module, ctx)

    def apply(self, module: nn.Module, mesh: DeviceMesh, ctx: ApplyContext) -> None:
        run_apply_override(self.torch_style, torch_style_class(self.torch_style, self.kind),
                           lambda m, device_mesh: self.style.apply(m, device_mesh, ctx), module, mesh, ctx.src_data_rank)


def _refuse(style: object, kind: str, names: list[str], what: str) -> TypeError:
    return TypeError(f"{what}: {type(style).__name__} overrides {', '.join(names)} of torch's {kind}, which "
                     f"shardwise cannot run without torch's implementation; use shardwise.composable.{kind} "
                     "(same arguments) or a shardwise ParallelStyle subclass")


def adopt(style: object, what: str) -> ParallelStyle | None:
    """The shardwise style for ``style`` when it is an instance of one of torch's style classes
    (or of a subclass), else None; ``what`` names the plan entry in errors. See [Note: torch's
    style objects in a plan]."""
    kind = torch_style_kind(style)
    if kind is None:
        return None
    ours = _adopt(style, kind, what)
    return TorchApply(ours, style, kind) if "_apply" in torch_style_overrides(style, kind) else ours


def _adopt(style: object, kind: str, what: str, half: bool = False) -> ParallelStyle:
    f = torch_style_fields(style, kind)
    overrides = torch_style_overrides(style, kind)
    hooks = kind in ("ColwiseParallel", "RowwiseParallel")
    refused = sorted(set(overrides) - {*(() if half else ("_apply",)), *(TORCH_HOOKS if hooks else ())})
    if refused:
        raise _refuse(style, kind, refused, what)
    if hooks:
        cls = ColwiseParallel if kind == "ColwiseParallel" else RowwiseParallel
        ours = cls(input_layouts=f["input_layouts"], output_layouts=f["output_layouts"][0],
                   use_local_output=f["use_local_output"])
        input_fn, output_fn = (overrides.get(name) for name in TORCH_HOOKS)
        if input_fn is None and output_fn is None:
            return ours
        return TorchHooks(ours, f["input_layouts"], f["output_layouts"], f["use_local_output"], input_fn, output_fn)
    if kind == "SequenceParallel":
        return SequenceParallel(sequence_dim=f["sequence_sharding"][0].dim, use_local_output=f["use_local_output"])
    if kind == "PrepareModuleInput":
        return PrepareModuleInput(**f)
    if kind == "PrepareModuleOutput":
        return PrepareModuleOutput(**f)
    i, o = _adopt(f["prepare_module_input"], "PrepareModuleInput", what, half=True), \
        _adopt(f["prepare_module_output"], "PrepareModuleOutput", what, half=True)
    assert isinstance(i, PrepareModuleInput) and isinstance(o, PrepareModuleOutput)
    return PrepareModuleInputOutput(input_layouts=i.input_layouts, desired_input_layouts=i.desired_input_layouts,
                                    input_kwarg_layouts=i.input_kwarg_layouts,
                                    desired_input_kwarg_layouts=i.desired_input_kwarg_layouts,
                                    use_local_input=i.use_local_output, output_layouts=o.output_layouts,
                                    desired_output_layouts=o.desired_output_layouts, use_local_output=o.use_local_output)
