"""The extension point: how a module class is split under a style, as data.

A `ModuleRule` says, for one module class under one style, where every parameter goes on the
tensor-parallel axis, which layout each input needs and which layout the output then has;
optionally a *local forward* ``forward(module, *inputs)`` computing this rank's share on plain
local tensors.

A `TPRegistry` maps ``(style class, module class)`` to rules. It is immutable (`with_rule`
returns a new one), so ``DEFAULT_REGISTRY`` (``nn.Linear``, ``nn.Embedding``) never changes behind
a caller's back; pass yours as ``parallelize_module(..., registry=...)``. Lookup walks the
module's MRO, then the style's, so rules cover subclasses.

Two ways a rule's module computes:

* **DTensor forward** (``forward=None``): inputs are converted with ``input_layouts`` and the
  module's own ``forward`` runs through DTensor's operators; the output must then have
  ``output_layout`` (else a clear error).
* **Local forward** (``forward=fn``): ``fn`` is bound as the instance's ``forward`` (hooks still
  run around it). It gets plain local tensors laid out per ``input_layouts`` (replicated ones
  via `to_local_share`, so their gradients sum over ranks), reads parameters itself (e.g.
  ``module.w.to_local()``), and returns this rank's output with layout ``output_layout``
  (typically ``Partial()``). The contract: replicated inputs and parameters get gradient
  contributions that sum to the true gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping

from torch import nn
from torch.distributed.tensor import Placement, Replicate

__all__ = ["ModuleRule", "TPRegistry"]


@dataclass(frozen=True)
class ModuleRule:
    """How one module class is split under one style.

    Attributes:
        params: parameter name (as in ``module.named_parameters()``) -> placement on the tp
            axis. Every parameter the module has must be listed; listed names it lacks (an
            absent bias) are skipped.
        input_layouts: the layout each positional input needs when the forward runs
            (``None``: leave that input alone). Inputs past the tuple are left alone.
        output_layout: the layout of the forward's (single tensor) output.
        input_sizes: optional ``fn(module) -> tuple`` of the global length of each input's
            sharded dimension when the module determines it (a Rowwise Linear's input width is
            ``in_features``); ``None`` entries make the ranks exchange lengths.
        forward: optional local forward, see the module docstring.
        check: optional ``fn(module)`` raising a clear error for unsupported configurations.
        summary: one line for error messages and reprs, e.g. ``"Y = X W^T, W split by rows"``.
    """

    params: Mapping[str, Placement]
    input_layouts: tuple[Placement | None, ...] = (Replicate(),)
    output_layout: Placement = Replicate()
    input_sizes: Callable[[nn.Module], tuple[int | None, ...]] | None = None
    forward: Callable[..., Any] | None = None
    check: Callable[[nn.Module], None] | None = None
    summary: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        layouts = self.input_layouts
        if isinstance(layouts, Placement) or layouts is None:
            layouts = (layouts,)
        object.__setattr__(self, "input_layouts", tuple(layouts))
        bad = [p for p in (*self.params.values(), *self.input_layouts, self.output_layout)
               if p is not None and not isinstance(p, Placement)]
        if bad:
            raise TypeError(f"ModuleRule: {bad} are not Placement instances (Shard(0), Replicate(), "
                            "Partial())")


class TPRegistry:
    """Immutable table ``(style class, module class) -> ModuleRule``.

    ``TPRegistry()`` is empty; ``DEFAULT_REGISTRY.with_rule(ColwiseParallel, FusedQKV, rule)``
    is the default rules plus one. Equality and hashing are by identity.
    """

    def __init__(self, rules: Mapping[tuple[type, type], ModuleRule] | None = None) -> None:
        table = dict(rules or {})
        for key, rule in table.items():
            _check_entry(*key, rule)
        self._rules: Mapping[tuple[type, type], ModuleRule] = MappingProxyType(table)

    def with_rule(self, style: type, module_cls: type[nn.Module], rule: ModuleRule) -> "TPRegistry":
        """A new registry: this one plus (or with replaced) ``(style, module_cls) -> rule``."""
        _check_entry(style, module_cls, rule)
        return TPRegistry({**self._rules, (style, module_cls): rule})

    def find(self, style: object, module: nn.Module) -> ModuleRule | None:
        """The rule for this style instance and module, most specific classes first, or None."""
        for mcls in type(module).__mro__:
            for scls in type(style).__mro__:
                rule = self._rules.get((scls, mcls))
                if rule is not None:
                    return rule
        return None

    def module_classes(self, style: object) -> list[str]:
        """Names of the module classes that have a rule under ``style`` (for messages)."""
        styles = set(type(style).__mro__)
        return sorted({m.__name__ for s, m in self._rules if s in styles})

    def __iter__(self) -> Iterator[tuple[type, type]]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def __getitem__(self, key: tuple[type, type]) -> ModuleRule:
        return self._rules[key]

    def __repr__(self) -> str:
        keys = ", ".join(f"({s.__name__}, {m.__name__})" for s, m in self._rules)
        return f"TPRegistry([{keys}])"


def _check_entry(style: Any, module_cls: Any, rule: Any) -> None:
    if not isinstance(style, type):
        raise TypeError(f"TPRegistry: key style must be a style class such as ColwiseParallel, "
                        f"got {style!r}")
    if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
        raise TypeError(f"TPRegistry: key module class must be an nn.Module subclass, got {module_cls!r}")
    if not isinstance(rule, ModuleRule):
        raise TypeError(f"TPRegistry: value must be a ModuleRule, got {type(rule).__name__}")
