"""The torch private API that tensor parallelism relies on, in one place.

``tests/test_tp_compat.py`` checks exactly what is relied on here against the installed torch,
so an upgrade that changes it fails there first.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, _mesh_resources

__all__ = ["current_mesh", "TORCH_STYLE_MODULE", "TORCH_HOOKS", "run_apply_override", "style_hooks", "torch_style_class",
           "torch_style_kind", "torch_style_fields", "torch_style_overrides"]

#: The module of torch's tensor-parallel style classes (named, never imported: see `torch_style_kind`).
TORCH_STYLE_MODULE = "torch.distributed.tensor.parallel.style"
#: torch's forward hooks of ``ColwiseParallel`` / ``RowwiseParallel``, input then output (`style_hooks`)
TORCH_HOOKS = ("_prepare_input_fn", "_prepare_output_fn")
_KINDS = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput",
          "PrepareModuleInputOutput")
# what each of torch's style classes keeps of its arguments, as attributes of the same names
_FIELDS = {
    "ColwiseParallel": ("input_layouts", "output_layouts", "use_local_output"),
    "RowwiseParallel": ("input_layouts", "output_layouts", "use_local_output"),
    "SequenceParallel": ("sequence_sharding", "use_local_output"),
    "PrepareModuleInput": ("input_layouts", "desired_input_layouts", "input_kwarg_layouts",
                           "desired_input_kwarg_layouts", "use_local_output"),
    "PrepareModuleOutput": ("output_layouts", "desired_output_layouts", "use_local_output"),
    "PrepareModuleInputOutput": ("prepare_module_input", "prepare_module_output"),
}


def current_mesh() -> DeviceMesh | None:
    """The innermost mesh entered with ``with mesh:``, or None outside any such block.

    torch's ``parallelize_module(module, parallelize_plan=...)`` takes its mesh from this
    context when none is passed. Relies on: ``DeviceMesh.__enter__`` pushing the mesh onto
    ``_mesh_resources.mesh_stack`` (a list, innermost last) and ``__exit__`` popping it.
    """
    stack = getattr(_mesh_resources, "mesh_stack", None)
    return stack[-1] if stack else None


def torch_style_kind(style: object) -> str | None:
    """The name of torch's style class that ``style`` is an instance of (its own class or a base
    class, as for torchao's ``Float8ColwiseParallel``), or None. Found by the classes' module and
    name, so this library never imports ``torch.distributed.tensor.parallel``."""
    for cls in type(style).__mro__:
        if cls.__module__ == TORCH_STYLE_MODULE and cls.__name__ in _KINDS:
            return cls.__name__
    return None


def torch_style_fields(style: object, kind: str) -> dict[str, Any]:
    """The arguments a torch style of class ``kind`` was built with, as it keeps them.

    Relies on: torch's ``__init__`` storing them as attributes: ``input_layouts`` and
    ``output_layouts`` as 1-tuples (defaults filled in) for ``ColwiseParallel`` /
    ``RowwiseParallel``; ``sequence_sharding`` as ``(Shard(sequence_dim),)``;
    ``PrepareModuleInput`` / ``PrepareModuleOutput`` their layouts as tuples (or None) and kwarg
    layouts as dicts; ``PrepareModuleInputOutput`` its two halves as ``prepare_module_input`` and
    ``prepare_module_output``; ``use_local_output`` as given.
    """
    return {name: getattr(style, name) for name in _FIELDS[kind]}


def torch_style_class(style: object, kind: str) -> type:
    """torch's style class ``kind`` in the classes of ``style`` (found by module and name)."""
    return next(c for c in type(style).__mro__ if c.__module__ == TORCH_STYLE_MODULE and c.__name__ == kind)


def torch_style_overrides(style: object, kind: str) -> dict[str, Callable]:
    """The methods of torch's style class ``kind`` that a class outside torch's style module
    overrides for ``style`` (a subclass such as torchao's ``Float8ColwiseParallel``): name -> the
    bound override. Empty for an instance of torch's class itself.

    Relies on: torch's styles running their forward hooks through ``_prepare_input_fn`` /
    ``_prepare_output_fn`` (static, called with the style's layouts first, then the module, its
    inputs or outputs, and the mesh), and applying through ``_apply``.
    """
    base = torch_style_class(style, kind)
    out = {}
    for name, value in vars(base).items():
        if name.startswith("__") or not callable(getattr(value, "__func__", value)):
            continue
        owner = next(c for c in type(style).__mro__ if name in vars(c))
        if owner.__module__ != TORCH_STYLE_MODULE:
            out[name] = getattr(style, name)
    return out


def style_hooks(style: object) -> tuple[Callable | None, Callable | None]:
    """torch's forward hooks ``(_prepare_input_fn, _prepare_output_fn)`` defined on ``style``
    (None for each it lacks). Relies on: torch's ``ColwiseParallel`` / ``RowwiseParallel``
    calling them with their layouts first, then the module, its inputs or output, and the mesh
    (as `torch_style_overrides` says)."""
    input_fn, output_fn = (getattr(style, name, None) for name in TORCH_HOOKS)
    return input_fn, output_fn


def run_apply_override(style: object, base: type, stand_in: Callable[[nn.Module, DeviceMesh], Any],
                       module: nn.Module, mesh: DeviceMesh, src_data_rank: int | None) -> None:
    """Run ``style``'s own ``_apply(module, mesh)`` (a subclass's override, e.g. one that checks
    the module and calls ``super()._apply``) with ``stand_in(module, mesh)`` as the ``_apply`` of
    ``base``, a class of ``style`` (torch's style class, or shardwise's when torch's names were
    rebound), which is what its ``super()._apply`` reaches. ``style`` is not changed: the
    override runs on a copy whose class puts the stand-in just before ``base``, with
    ``src_data_rank`` set first, as torch's ``parallelize_module`` sets it.

    Relies on: torch's ``parallelize_module`` applying a style through ``style._apply(module,
    device_mesh)`` after setting ``style.src_data_rank``."""
    def _apply(_self: object, m: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        stand_in(m, device_mesh)
        return m

    shim = type(base)(base.__name__, (base,), {"_apply": _apply, "__module__": __name__})
    meta: Any = type(type(style))
    cls = meta(type(style).__name__, (type(style), shim), {"__module__": type(style).__module__})
    twin = copy.copy(style)
    object.__setattr__(twin, "__class__", cls)
    object.__setattr__(twin, "src_data_rank", src_data_rank)
    twin._apply(module, mesh)  # type: ignore[attr-defined]
