"""`PrepareModuleInput`, `PrepareModuleOutput`, `PrepareModuleInputOutput`: layouts only.

These styles touch no parameter: they annotate a module's inputs (positional and keyword) or
outputs with their layout and redistribute them to the one wanted, e.g.
``PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))``
gathers a sequence-sharded activation before attention. ``None`` leaves an argument alone. Plain
tensors are taken to have the given layout (equal pieces unless ``uneven_shards=True``:
`as_dtensor`); a DTensor keeps its own. Names, defaults and errors (`LayoutsMismatchError`, an
``AssertionError`` as in torch, and a ``ValueError``) follow torch's styles of the same names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Mapping, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from ._layouts import to_layout
from ._styles import ApplyContext, ParallelStyle, as_layout_tuple

__all__ = ["PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "LayoutsMismatchError"]


class LayoutsMismatchError(ValueError, AssertionError):
    """Layouts and desired layouts that do not pair up (torch raises ``AssertionError``)."""


def _pair(given: Any, desired: Any, what: str, names: tuple[str, str]) -> tuple[tuple | None, tuple | None]:
    given = as_layout_tuple(given, f"{what}: {names[0]}")
    desired = as_layout_tuple(desired, f"{what}: {names[1]}")
    if given is not None and (desired is None or len(given) != len(desired)):
        raise LayoutsMismatchError(
            f"{what}: {names[0]} and {names[1]} should have same length! Got {given} and {desired}; "
            "give both one entry per argument (None for an argument to leave alone)")
    return given, desired


def _kwarg_pair(given: Any, desired: Any, what: str) -> tuple[Mapping, Mapping]:
    given, desired = dict(given or {}), dict(desired or {})
    if set(given) != set(desired):
        raise LayoutsMismatchError(
            f"{what}: input_kwarg_layouts keys {sorted(given)} and desired_input_kwarg_layouts "
            f"keys {sorted(desired)} should be the same; name each keyword in both")
    for d in (given, desired):
        as_layout_tuple(tuple(d.values()), f"{what}: kwarg layouts")
    return MappingProxyType(given), MappingProxyType(desired)


def _convert(x: Any, mesh: DeviceMesh, given: Placement | None, desired: Placement | None,
             use_local: bool, uneven: bool) -> Any:
    if given is None:
        return x
    x = to_layout(x, mesh, given, desired, uneven=uneven)
    return x.to_local() if use_local and isinstance(x, DTensor) else x


@dataclass(frozen=True, kw_only=True)
class PrepareModuleInput(ParallelStyle):
    """Lay out a module's inputs before its forward.

    Args:
        input_layouts: layout of each positional input (a Placement for one input); None
            entries are left alone. The module must get exactly this many positional inputs.
        desired_input_layouts: the layout each is redistributed to; same length.
        input_kwarg_layouts / desired_input_kwarg_layouts: the same for keyword arguments, by
            name (same keys); a keyword not passed in a call is skipped.
        use_local_output: hand the forward local tensors instead of DTensors (default False).
        uneven_shards: plain ``Shard`` inputs may be uneven ``torch.chunk`` pieces (one small
            all-gather of lengths per input per call; default: equal pieces, as torch). Not a
            torch argument.
    """

    shards_parameters: ClassVar[bool] = False

    input_layouts: Placement | tuple[Placement | None, ...] | None = None
    desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None
    input_kwarg_layouts: Mapping[str, Placement] | None = None
    desired_input_kwarg_layouts: Mapping[str, Placement] | None = None
    use_local_output: bool = False
    uneven_shards: bool = False

    def __post_init__(self) -> None:
        what = type(self).__name__
        given, desired = _pair(self.input_layouts, self.desired_input_layouts, what,
                               ("input_layouts", "desired_input_layouts"))
        kw, dkw = _kwarg_pair(self.input_kwarg_layouts, self.desired_input_kwarg_layouts, what)
        for name, value in (("input_layouts", given), ("desired_input_layouts", desired),
                            ("input_kwarg_layouts", kw), ("desired_input_kwarg_layouts", dkw)):
            object.__setattr__(self, name, value)

    def apply(self, module: nn.Module, mesh: DeviceMesh, ctx: ApplyContext) -> None:
        where = ctx.where(self, module)
        # tuples and read-only mappings after __post_init__
        given = cast("tuple[Placement | None, ...] | None", self.input_layouts)
        desired = cast("tuple[Placement | None, ...]", self.desired_input_layouts)
        kw = cast(Mapping[str, Placement], self.input_kwarg_layouts)
        dkw = cast(Mapping[str, Placement], self.desired_input_kwarg_layouts)
        local = self.use_local_output
        uneven = self.uneven_shards

        def prepare(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if given is not None:
                if len(args) != len(given):
                    raise ValueError(f"{where}: module inputs and input_layouts should have same length! "
                                     f"forward got {len(args)} positional inputs, the plan lays out "
                                     f"{len(given)} ({given}); use None for inputs to leave alone")
                args = tuple(_convert(a, mesh, g, d, local, uneven) for a, g, d in zip(args, given, desired))
            if kw:
                kwargs = {k: _convert(v, mesh, kw.get(k), dkw.get(k), local, uneven) for k, v in kwargs.items()}
            return args, kwargs

        module.register_forward_pre_hook(prepare, with_kwargs=True)


@dataclass(frozen=True, kw_only=True)
class PrepareModuleOutput(ParallelStyle):
    """Lay out a module's outputs after its forward.

    Args:
        output_layouts: layout of each output (a Placement for a single tensor output); None
            entries are left alone. The forward must return this many outputs (a tuple for
            more than one).
        desired_output_layouts: the layout each is redistributed to; same length.
        use_local_output: return local tensors (default True).
        uneven_shards: plain ``Shard`` outputs may be uneven ``torch.chunk`` pieces (see
            `PrepareModuleInput`). Not a torch argument.
    """

    shards_parameters: ClassVar[bool] = False

    output_layouts: Placement | tuple[Placement | None, ...]
    desired_output_layouts: Placement | tuple[Placement | None, ...]
    use_local_output: bool = True
    uneven_shards: bool = False

    def __post_init__(self) -> None:
        given, desired = _pair(self.output_layouts, self.desired_output_layouts, type(self).__name__,
                               ("output_layouts", "desired_output_layouts"))
        object.__setattr__(self, "output_layouts", given)
        object.__setattr__(self, "desired_output_layouts", desired)

    def apply(self, module: nn.Module, mesh: DeviceMesh, ctx: ApplyContext) -> None:
        where = ctx.where(self, module)
        given = cast("tuple[Placement | None, ...]", self.output_layouts)  # tuples after __post_init__
        desired = cast("tuple[Placement | None, ...]", self.desired_output_layouts)
        local, uneven = self.use_local_output, self.uneven_shards

        def prepare(mod: nn.Module, args: tuple, out: Any) -> Any:
            single = not isinstance(out, tuple)
            outs = (out,) if single else out
            if len(outs) != len(given):
                raise ValueError(f"{where}: module outputs and output_layouts should have same length! "
                                 f"forward returned {len(outs)} output(s), the plan lays out "
                                 f"{len(given)} ({given}); use None for outputs to leave alone")
            outs = tuple(_convert(o, mesh, g, d, local, uneven) for o, g, d in zip(outs, given, desired))
            return outs[0] if single else outs

        module.register_forward_hook(prepare)


@dataclass(frozen=True, kw_only=True)
class PrepareModuleInputOutput(ParallelStyle):
    """`PrepareModuleInput` and `PrepareModuleOutput` on one module (``use_local_input`` is the
    former's ``use_local_output``; ``uneven_shards`` applies to both)."""

    shards_parameters: ClassVar[bool] = False

    input_layouts: Placement | tuple[Placement | None, ...] | None = None
    desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None
    input_kwarg_layouts: Mapping[str, Placement] | None = None
    desired_input_kwarg_layouts: Mapping[str, Placement] | None = None
    use_local_input: bool = False
    output_layouts: Placement | tuple[Placement | None, ...]
    desired_output_layouts: Placement | tuple[Placement | None, ...]
    use_local_output: bool = True
    uneven_shards: bool = False
    _parts: tuple = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        inp = PrepareModuleInput(
            input_layouts=self.input_layouts, desired_input_layouts=self.desired_input_layouts,
            input_kwarg_layouts=self.input_kwarg_layouts,
            desired_input_kwarg_layouts=self.desired_input_kwarg_layouts,
            use_local_output=self.use_local_input, uneven_shards=self.uneven_shards)
        out = PrepareModuleOutput(output_layouts=self.output_layouts,
                                  desired_output_layouts=self.desired_output_layouts,
                                  use_local_output=self.use_local_output, uneven_shards=self.uneven_shards)
        object.__setattr__(self, "_parts", (inp, out))

    def apply(self, module: nn.Module, mesh: DeviceMesh, ctx: ApplyContext) -> None:
        for part in self._parts:
            part.apply(module, mesh, ctx)
