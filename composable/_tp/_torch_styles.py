"""Plans that name torch's style classes: each entry runs as the shardwise style of the same name.

[Note: torch's style objects in a plan]
Code written for torch's tensor parallelism builds its plans from torch's classes
(``torch.distributed.tensor.parallel.ColwiseParallel``, ...) or from subclasses of them:
torchao's float8 training (and torchtitan with it) passes ``Float8ColwiseParallel`` /
``Float8RowwiseParallel``, which keep torch's parameter sharding and override the two forward
hooks to cast the input to float8 before its all-gather and the output gradient to float8 in
the backward. With only its imports changed, such code hands those objects to shardwise's
`parallelize_module`.

`adopt` turns each into the shardwise style of the same name, built from the arguments the
object keeps (``_compat.torch_style_fields``): parameters are distributed, and inputs and
outputs laid out, by shardwise's rules; torch's implementation never runs. A subclass's
overrides of ``_prepare_input_fn`` / ``_prepare_output_fn`` on ``ColwiseParallel`` /
``RowwiseParallel`` are the subclass's own code and run as torch runs them (`TorchHooks`): as
the module's forward pre-hook and forward hook, called with the style's layouts (the desired
input layout being the one the shardwise rule needs, which is torch's too), the module, its
inputs or output, and the mesh. Any other override would need torch's own ``_apply`` or
per-argument conversion to run, so it is refused in one line that names the shardwise style to
use instead; the one exception is an ``_apply`` that only checks the module before calling
torch's (`CHECKS_ONLY`, torchao's float8 styles): it is not called, and a module it would
have refused fails in the hooks instead (they read the ``Float8Linear``'s config).

The same two hooks defined on a subclass of shardwise's ``ColwiseParallel`` /
``RowwiseParallel`` run the same way (`ModuleParallel.torch_hooks`): that is what torchao's
float8 classes are when torch's names were rebound to shardwise's before torchao was imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ._compat import torch_style_fields, torch_style_kind, torch_style_overrides
from ._prepare import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput
from ._sequence import SequenceParallel
from ._styles import ApplyContext, ColwiseParallel, ModuleParallel, ParallelStyle, RowwiseParallel, check_torch_hooks

__all__ = ["adopt", "TorchHooks", "CHECKS_ONLY"]

#: ``_apply`` overrides that only check the module before calling torch's (torchao's float8
#: parameter styles: a ``Float8Linear`` with dynamic scaling), by module and qualified name.
CHECKS_ONLY = frozenset(f"torchao.float8.float8_tensor_parallel.Float8{k}Parallel._apply" for k in ("Colwise", "Rowwise"))
_HOOKS = ("_prepare_input_fn", "_prepare_output_fn")


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
    f = torch_style_fields(style, kind)
    overrides = torch_style_overrides(style, kind)
    allowed = set(_HOOKS) if kind in ("ColwiseParallel", "RowwiseParallel") else set()
    apply = overrides.get("_apply")
    if apply is not None and f"{apply.__module__}.{apply.__qualname__}" in CHECKS_ONLY:
        allowed.add("_apply")
    refused = sorted(set(overrides) - allowed)
    if refused:
        raise _refuse(style, kind, refused, what)
    if kind in ("ColwiseParallel", "RowwiseParallel"):
        cls = ColwiseParallel if kind == "ColwiseParallel" else RowwiseParallel
        ours = cls(input_layouts=f["input_layouts"], output_layouts=f["output_layouts"][0],
                   use_local_output=f["use_local_output"])
        if not set(overrides) & set(_HOOKS):
            return ours
        return TorchHooks(ours, f["input_layouts"], f["output_layouts"], f["use_local_output"],
                          overrides.get("_prepare_input_fn"), overrides.get("_prepare_output_fn"))
    if kind == "SequenceParallel":
        return SequenceParallel(sequence_dim=f["sequence_sharding"][0].dim, use_local_output=f["use_local_output"])
    if kind == "PrepareModuleInput":
        return PrepareModuleInput(**f)
    if kind == "PrepareModuleOutput":
        return PrepareModuleOutput(**f)
    i, o = adopt(f["prepare_module_input"], what), adopt(f["prepare_module_output"], what)
    assert isinstance(i, PrepareModuleInput) and isinstance(o, PrepareModuleOutput)
    return PrepareModuleInputOutput(input_layouts=i.input_layouts, desired_input_layouts=i.desired_input_layouts,
                                    input_kwarg_layouts=i.input_kwarg_layouts,
                                    desired_input_kwarg_layouts=i.desired_input_kwarg_layouts,
                                    use_local_input=i.use_local_output, output_layouts=o.output_layouts,
                                    desired_output_layouts=o.desired_output_layouts, use_local_output=o.use_local_output)
