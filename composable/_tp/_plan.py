"""`parallelize_module`: apply a tensor-parallel plan to a module tree.

A plan is one style (for ``module`` itself) or a mapping ``pattern -> style``, a pattern being a
dotted module name relative to ``module`` whose ``fnmatch`` wildcards match within one name
component (``"layers.*.feed_forward.w1"``; ``"layers.*"`` does not match ``"layers.0.attention"``;
``""`` is ``module``).

The whole plan is checked before anything changes: a pattern matching nothing is skipped with a
`PlanWarning` listing the closest names (a `PlanError` with ``strict=True``); at most one entry
may shard a module's parameters ([Note: overlapping plan entries]); every style validates its
module. Then the styles are applied in plan order. torch's style objects (and subclasses
such as torchao's ``Float8ColwiseParallel``) run as the shardwise style of the same name ([Note:
torch's style objects in a plan] in ``_torch_styles.py``). As in torch, no ``device_mesh`` takes
the innermost ``with mesh:`` block's mesh; no plan warns and returns the module unchanged.
"""

from __future__ import annotations

import difflib
import re
import warnings
from fnmatch import fnmatchcase
from typing import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ._builtin import DEFAULT_REGISTRY
from ._compat import current_mesh, torch_style_kind
from ._layouts import check_tp_mesh
from ._registry import TPRegistry
from ._styles import ApplyContext, ParallelStyle
from ._torch_styles import adopt

__all__ = ["parallelize_module", "match_plan", "PlanError", "PlanTypeError", "PlanWarning", "NoMeshError"]


class PlanError(ValueError):
    """A plan that cannot be applied: overlapping patterns, unmatched ones under ``strict``."""


class PlanTypeError(PlanError, TypeError):
    """A plan, key or value of the wrong type (torch raises ``TypeError``)."""


class PlanWarning(UserWarning):
    """A plan pattern that matches no submodule and was skipped (torch warns too)."""


class NoMeshError(RuntimeError):
    """No ``device_mesh`` passed and no ``with mesh:`` block active (torch: ``RuntimeError``)."""


def _matches(pattern: str, fqn: str) -> bool:
    if pattern == "":
        return fqn == ""
    parts, names = pattern.split("."), fqn.split(".") if fqn else []
    return len(parts) == len(names) and all(fnmatchcase(n, p) for p, n in zip(parts, names))


def _near_misses(pattern: str, fqns: list[str]) -> list[str]:
    """Close module names: by spelling (difflib), and names ending like the pattern; list
    indices are also offered as ``*`` (``layers.*.attention``)."""
    generic = sorted({re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", f) for f in fqns} - set(fqns))
    pool = generic + [f for f in fqns if f]
    close = difflib.get_close_matches(pattern, pool, n=5, cutoff=0.6)
    last = pattern.rpartition(".")[2]
    same_end = [f for f in pool if fnmatchcase(f.rpartition(".")[2], last)]
    return list(dict.fromkeys(close + same_end))[:5]


# [Note: overlapping plan entries]
# As in torch, every entry applies to every module it matches, in plan order (``{"layers.*":
# PrepareModuleInput(...), "layers.0.attn": ColwiseParallel()}`` both take effect), but at most one
# may shard a module's parameters (`ParallelStyle.shards_parameters`): torch fails on the second
# after changing the model; we refuse the plan before touching anything.


def match_plan(module: nn.Module, plan: Mapping[str, object],
               strict: bool = True) -> list[tuple[str, nn.Module, ParallelStyle]]:
    """``[(fqn, submodule, style)]`` in plan order, module order within a pattern.

    A module matched by several patterns gets each style, in plan order, as torch applies them
    ([Note: overlapping plan entries]). Raises `PlanTypeError` for a non-string key or non-style
    value, `PlanError` for a module two of whose entries shard its parameters; a pattern matching nothing (the message names near misses) is a
    `PlanError` if ``strict``, else a `PlanWarning` and skipped.
    """
    modules = dict(module.named_modules())
    fqns = list(modules)
    out: list[tuple[str, nn.Module, ParallelStyle]] = []
    owner: dict[str, str] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str):
            raise PlanTypeError(f"plan key {pattern!r} is not a string module pattern; use dotted "
                                "module names such as 'layers.*.attention.wq'")
        if not isinstance(style, ParallelStyle):
            style = adopt(style, f"plan[{pattern!r}]") or style  # [Note: torch's style objects in a plan]
        if not isinstance(style, ParallelStyle):
            raise PlanTypeError(f"plan[{pattern!r}] = {style!r} is not a ParallelStyle (shardwise's, or one of "
                                "torch's tensor-parallel style classes)")
        hits = [f for f in fqns if _matches(pattern, f)]
        if not hits:
            near = _near_misses(pattern, fqns)
            hint = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else ""
            msg = (f"plan pattern {pattern!r} matches no submodule of {type(module).__name__}{hint} "
                   "('*' matches within one dotted name)")
            if strict:
                raise PlanError(msg)
            warnings.warn(f"{msg}; skipping this plan entry", PlanWarning, stacklevel=3)
            continue
        for f in hits:
            if style.shards_parameters and f in owner:
                raise PlanError(f"module '{f}' is matched by plan patterns {owner[f]!r} and "
                                f"{pattern!r}, which both shard its parameters; give it one of them "
                                "(only hook styles such as PrepareModuleInput may add to another entry)")
            if style.shards_parameters:
                owner[f] = pattern
            out.append((f, modules[f], style))
    return out


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh | None = None,
                       parallelize_plan: ParallelStyle | Mapping[str, ParallelStyle] | None = None, *,
                       src_data_rank: int | None = 0, registry: TPRegistry = DEFAULT_REGISTRY,
                       strict: bool = False) -> nn.Module:
    """Apply tensor-parallel styles to ``module`` in place and return it.

    Args:
        module: the model (or a part of it); every rank holds the same full module.
        device_mesh: the 1-D tensor-parallel mesh, e.g. ``init_mesh(...)["tp"]``; None: the
            mesh of the innermost ``with mesh:`` block (`NoMeshError` if there is none).
        parallelize_plan: a style for ``module`` itself, or ``{pattern: style}`` (see the
            module docstring for patterns); None: warn and return ``module`` unchanged.
        src_data_rank: the rank whose parameter values are distributed (default 0, one
            scatter/broadcast per parameter); None: every rank slices its own copy, no
            communication (the copies must already agree).
        registry: the rules Colwise/Rowwise/ModuleParallel use per module class
            (default: the immutable ``DEFAULT_REGISTRY`` for Linear and Embedding).
        strict: a pattern that matches nothing raises `PlanError` instead of warning.

    ``registry`` and ``strict`` are shardwise's; the rest is torch's signature and meaning.
    Raises `PlanTypeError` (a ``TypeError``) for a plan of the wrong type, `PlanError` (a
    ``ValueError``) for overlapping patterns, `UnsupportedModuleTypeError` (a ``TypeError``
    and ``NotImplementedError``) for a module a style has no rule for: all before anything
    is changed.
    """
    if device_mesh is None:
        device_mesh = current_mesh()
        if device_mesh is None:
            raise NoMeshError("parallelize_module: no device_mesh given and no `with mesh:` block is "
                              "active; pass device_mesh=init_mesh(...)['tp'] or call it inside `with tp_mesh:`")
    if parallelize_plan is None:
        warnings.warn("parallelize_module: no parallelize_plan given, so the module is returned "
                      "unchanged; pass a style or {pattern: style}", UserWarning, stacklevel=2)
        return module
    check_tp_mesh(device_mesh, "parallelize_module")
    if not isinstance(registry, TPRegistry):
        raise TypeError(f"parallelize_module(registry=...) takes a TPRegistry, got {type(registry).__name__}")
    if src_data_rank is not None and not (isinstance(src_data_rank, int)
                                          and 0 <= src_data_rank < device_mesh.size()):
        raise ValueError(f"parallelize_module(src_data_rank={src_data_rank!r}): use a rank of the "
                         f"mesh, 0..{device_mesh.size() - 1}, or None to keep each rank's own values")
    if isinstance(parallelize_plan, ParallelStyle) or torch_style_kind(parallelize_plan) is not None:
        plan: Mapping[str, object] = {"": parallelize_plan}
    elif isinstance(parallelize_plan, Mapping):
        plan = parallelize_plan
    else:
        raise PlanTypeError(f"parallelize_plan must be a ParallelStyle or a dict of pattern -> style, "
                            f"got {type(parallelize_plan).__name__}")
    entries = match_plan(module, plan, strict=strict)
    contexts = [ApplyContext(registry, src_data_rank, fqn) for fqn, _, _ in entries]
    for (fqn, sub, style), ctx in zip(entries, contexts):
        style.validate(sub, ctx)
    for (fqn, sub, style), ctx in zip(entries, contexts):
        style.apply(sub, device_mesh, ctx)
    return module
