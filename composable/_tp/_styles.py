"""Parallel styles driven by registry rules: `ModuleParallel`, `ColwiseParallel`, `RowwiseParallel`.

Notation: ``p`` tensor-parallel ranks; an ``nn.Linear`` computes ``Y = X W^T + b`` with
``W`` of shape ``[out, in]``. ``W = [W_1; ...; W_p]`` stacks row blocks (split of ``out``),
``W = [W_1 ... W_p]`` puts column blocks side by side (split of ``in``). Blocks follow the
``torch.chunk`` layout, so sizes need not divide ``p``.

Applying one of these styles to a module (see `ModuleParallel.apply`):

1. look up the `ModuleRule` for (style, module class) in the registry;
2. turn every parameter into a DTensor with the rule's placement (`distribute_params`);
3. a forward pre-hook lays out input 0 (and further inputs the rule names): a plain tensor
   is taken to have ``input_layouts`` (the style argument; default: what the rule needs),
   then redistributed to what the rule needs;
4. a forward hook redistributes the output to ``output_layouts`` and, with
   ``use_local_output=True`` (default), returns the local tensor.

Defaults and argument names follow torch's styles of the same names, so plans written for
torch's own tensor-parallel API run unchanged. One deliberate difference: torch's
``RowwiseParallel`` assumes ``input_layouts=Shard(-1)`` even for ``nn.Embedding`` (whose input
is token ids); here the default is the rule's ``Replicate()``. Plans that pass
``input_layouts=Replicate()`` for embeddings, as torch's examples do, behave the same.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from ._compat import TORCH_HOOKS, run_apply_override, style_hooks
from ._layouts import as_dtensor, to_layout, to_local_share
from ._params import check_not_distributed, distribute_params
from ._registry import ModuleRule, TPRegistry

__all__ = ["ApplyContext", "ParallelStyle", "ModuleParallel", "ColwiseParallel", "RowwiseParallel",
           "UnsupportedModuleTypeError", "as_layout_tuple", "check_torch_hooks"]


@dataclass(frozen=True)
class ApplyContext:
    """What `parallelize_module` passes to every style: rules, data source, and the FQN."""

    registry: TPRegistry
    src_data_rank: int | None = 0
    fqn: str = ""

    def where(self, style: object, module: nn.Module) -> str:
        name = f"'{self.fqn}'" if self.fqn else "the root module"
        return f"{type(style).__name__} on {name} ({type(module).__name__})"


class UnsupportedModuleTypeError(TypeError, NotImplementedError):
    """A style has no rule for the module's class (torch raises ``NotImplementedError``)."""


class ParallelStyle:
    """How to parallelize one module on a 1-D tensor-parallel mesh.

    Subclasses implement `apply`; `validate` runs first for every entry of a plan, before any
    module is changed, so a bad plan leaves the model untouched.

    torch's protocol works too: a subclass that implements ``_apply(module, device_mesh)``
    (and reads ``self.src_data_rank``, which `parallelize_module` sets first, as torch does)
    is applied through it.
    """

    src_data_rank: int | None = 0
    #: False for styles that only add hooks (the ``Prepare*`` ones): a module may be matched by
    #: several plan entries if at most one of them shards its parameters ([Note: overlapping plan entries]).
    shards_parameters: ClassVar[bool] = True

    def validate(self, module: nn.Module, ctx: ApplyContext) -> None:
        """Raise a clear error if this style cannot apply to ``module``; change nothing."""

    def apply(self, module: nn.Module, mesh: DeviceMesh, ctx: ApplyContext) -> None:
        """Parallelize ``module`` in place on ``mesh`` (default: torch's ``_apply``)."""
        if type(self)._apply is ParallelStyle._apply:
            raise NotImplementedError(f"{type(self).__name__} implements neither apply(module, mesh, "
                                      "ctx) nor torch's _apply(module, device_mesh); define one")
        self.src_data_rank = ctx.src_data_rank
        self._apply(module, mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        """torch's hook for user-defined styles; see the class docstring."""
        raise NotImplementedError


def check_torch_hooks(hooks: tuple[Callable | None, Callable | None], rule: ModuleRule, where: str) -> None:
    """torch's forward hooks (`ModuleParallel.torch_hooks`) run on the module's DTensor forward:
    refuse them for a rule whose forward runs on local shards."""
    if any(h is not None for h in hooks) and rule.forward is not None:
        raise ValueError(f"{where}: the style's own torch forward hooks ({' / '.join(TORCH_HOOKS)}) need "
                         "the module's forward to run on DTensors, and shardwise runs this module's on local "
                         "shards; use the shardwise style without them")


def as_layout_tuple(layouts: Placement | tuple | list | None, what: str) -> tuple | None:
    """A Placement or a sequence of Placement/None as a tuple (None stays None)."""
    if layouts is None:
        return None
    if isinstance(layouts, Placement):
        return (layouts,)
    if isinstance(layouts, type):
        raise TypeError(f"{what}: got the class {layouts.__name__}; pass an instance, "
                        f"e.g. {layouts.__name__}()")
    out = tuple(layouts)
    bad = [x for x in out if x is not None and not isinstance(x, Placement)]
    if bad:
        raise TypeError(f"{what}: {bad} are not Placements (Shard(d), Replicate(), Partial()) or None")
    return out


@dataclass(frozen=True, kw_only=True)
class ModuleParallel(ParallelStyle):
    """Split a module exactly as its registry rule says (the generic rule-driven style).

    Use it directly for module classes registered under ``ModuleParallel`` (for example a
    mixture-of-experts layer); `ColwiseParallel` and `RowwiseParallel` are the same machinery
    with their own rules. Communication is whatever the layout changes cost: none when the
    input already has the needed layout, ``Partial -> Replicate`` an all-reduce,
    ``Partial -> Shard`` a reduce-scatter, ``Shard -> Replicate`` an all-gather.

    Args:
        input_layouts: layout of a plain-tensor input 0 (or a tuple, per input); default: the
            layout the rule needs, i.e. no conversion.
        output_layouts: layout of the output; default: the rule's output layout, with
            ``Partial`` turned into ``Replicate`` (a partial sum is never handed out).
        use_local_output: return the local tensor (default) instead of the DTensor.
        uneven_shards: a plain input laid out as ``Shard(d)`` may be an uneven
            (``torch.chunk``) piece whose global length the module does not determine: the
            ranks exchange lengths, one small all-gather per call (default False: equal
            pieces, as torch; see `as_dtensor`). Not a torch argument.
    """

    input_layouts: Placement | tuple[Placement | None, ...] | None = None
    output_layouts: Placement | None = None
    use_local_output: bool = True
    uneven_shards: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        object.__setattr__(self, "input_layouts", as_layout_tuple(self.input_layouts, f"{name}(input_layouts)"))
        if self.output_layouts is not None and not isinstance(self.output_layouts, Placement):
            raise TypeError(f"{name}(output_layouts=...) takes one Placement instance, "
                            f"got {self.output_layouts!r}")

    def _rule(self, module: nn.Module, ctx: ApplyContext) -> ModuleRule:
        rule = ctx.registry.find(self, module)
        if rule is None:
            known = ctx.registry.module_classes(self) or ["nothing"]
            raise UnsupportedModuleTypeError(
                f"{ctx.where(self, module)}: no rule for {type(module).__name__}; this style knows "
                f"{', '.join(known)}. Register one: registry = DEFAULT_REGISTRY.with_rule("
                f"{type(self).__name__}, {type(module).__name__}, ModuleRule(...)) and pass "
                "parallelize_module(..., registry=registry)")
        return rule

    def _layouts(self, rule: ModuleRule, where: str) -> tuple[tuple, Placement]:
        """(layout of each plain input, layout of the output) for this style and rule."""
        needed = rule.input_layouts
        given = cast("tuple[Placement | None, ...] | None", self.input_layouts) or needed  # a tuple after __post_init__
        if len(given) > len(needed):
            raise ValueError(f"{where}: input_layouts has {len(given)} entries but the rule lays out "
                             f"{len(needed)} input(s) {needed}; use PrepareModuleInput for the others")
        out = self.output_layouts
        if out is None:
            out = Replicate() if isinstance(rule.output_layout, Partial) else rule.output_layout
        return given + needed[len(given):], out

    def validate(self, module: nn.Module, ctx: ApplyContext) -> None:
        rule = self._rule(module, ctx)
        self._layouts(rule, ctx.where(self, module))
        check_not_distributed(module, ctx.where(self, module))
        if rule.check is not None:
            rule.check(module)
        if rule.forward is not None and "forward" in vars(module):
            raise ValueError(f"{ctx.where(self, module)}: the instance already has its own forward "
                             "attribute; a rule with a local forward needs to bind it")
        check_torch_hooks(self.torch_hooks(), rule, ctx.where(self, module))

    def torch_hooks(self) -> tuple[Callable | None, Callable | None]:
        """torch's forward hooks a subclass defines, input then output (None for each it does
        not): a subclass of this class written for torch's, such as torchao's float8 styles when
        torch's names are rebound to shardwise's. They run as torch runs them ([Note: torch's
        style objects in a plan] in ``_torch_styles.py``)."""
        return style_hooks(self)

    def apply(self, module: nn.Module, mesh: DeviceMesh, ctx: ApplyContext) -> None:
        """Apply the rule; a subclass's own ``_apply`` (torch's protocol: it may check the
        module and call ``super()._apply``) runs first, with the rule standing in for the base
        class ([Note: torch's style objects in a plan] in ``_torch_styles.py``)."""
        if type(self)._apply is not ParallelStyle._apply:
            return run_apply_override(self, ParallelStyle, lambda m, device_mesh: self._apply_rule(m, device_mesh, ctx),
                                      module, mesh, ctx.src_data_rank)
        self._apply_rule(module, mesh, ctx)

    def _apply_rule(self, module: nn.Module, mesh: DeviceMesh, ctx: ApplyContext) -> None:
        input_fn, output_fn = self.torch_hooks()
        if input_fn is None and output_fn is None:
            return self.install(module, mesh, ctx)
        given, out = self._layouts(self._rule(module, ctx), ctx.where(self, module))
        self.install_torch_hooks(module, mesh, ctx, input_fn, output_fn, given[:1], (out,), self.use_local_output)

    def install_torch_hooks(self, module: nn.Module, mesh: DeviceMesh, ctx: ApplyContext, input_fn: Callable | None,
                            output_fn: Callable | None, input_layouts: tuple, output_layouts: tuple,
                            use_local_output: bool) -> None:
        """`install` with torch's hooks ``input_fn(input_layouts, desired_input_layouts, module,
        inputs, mesh)`` / ``output_fn(output_layouts, use_local_output, module, output, mesh)`` in
        place of this style's own, where given; the desired input layout is the rule's."""
        desired = tuple(self._rule(module, ctx).input_layouts[:1])
        pre = post = None
        if input_fn is not None:
            def pre(mod: nn.Module, args: tuple) -> Any:
                return input_fn(input_layouts, desired, mod, args, mesh)
        if output_fn is not None:
            def post(mod: nn.Module, args: tuple, out: Any) -> Any:
                return output_fn(output_layouts, use_local_output, mod, out, mesh)
        self.install(module, mesh, ctx, input_hook=pre, output_hook=post)

    def install(self, module: nn.Module, mesh: DeviceMesh, ctx: ApplyContext, *,
                input_hook: Callable[[nn.Module, tuple], Any] | None = None,
                output_hook: Callable[[nn.Module, tuple, Any], Any] | None = None) -> None:
        """`apply`, with the forward pre-hook (``input_hook(module, args)``) or the forward hook
        (``output_hook(module, args, output)``) given instead of the style's own: a torch style
        subclass's hooks ([Note: torch's style objects in a plan] in ``_torch_styles.py``)."""
        rule = self._rule(module, ctx)
        where = ctx.where(self, module)
        distribute_params(module, mesh, rule.params, src_data_rank=ctx.src_data_rank, what=where)
        needed = rule.input_layouts
        given, out_layout = self._layouts(rule, where)
        local = rule.forward is not None

        def lay_out_inputs(mod: nn.Module, args: tuple) -> tuple:
            sizes = rule.input_sizes(mod) if rule.input_sizes is not None else ()
            new = list(args)
            for i, (have, want) in enumerate(zip(given, needed)):
                if i >= len(new) or want is None:
                    continue
                size = sizes[i] if i < len(sizes) and have == want else None
                t = to_layout(new[i], mesh, have, want, global_size=size, uneven=self.uneven_shards)
                new[i] = to_local_share(t) if local and isinstance(t, DTensor) else t
            return tuple(new)

        def lay_out_output(mod: nn.Module, args: tuple, out):
            if local:
                out = as_dtensor(out, mesh, rule.output_layout, uneven=self.uneven_shards)
            elif not isinstance(out, DTensor):
                raise TypeError(f"{where}: forward returned {type(out).__name__}, not a DTensor; "
                                "a module whose forward does not run on DTensors needs a rule with "
                                "a local forward")
            out = to_layout(out, mesh, None, out_layout)
            return out.to_local() if self.use_local_output else out

        module.register_forward_pre_hook(input_hook or lay_out_inputs)
        module.register_forward_hook(output_hook or lay_out_output)
        if rule.forward is not None:
            module.forward = functools.partial(rule.forward, module)


@dataclass(frozen=True, kw_only=True)
class ColwiseParallel(ModuleParallel):
    """Split the output features: each rank computes its block of output columns.

    ``nn.Linear``: ``W = [W_1; ...; W_p]`` (rows, ``Shard(0)``), ``b = [b_1 ... b_p]``
    (``Shard(0)``), ``Y_r = X W_r^T + b_r``, so ``Y = [Y_1 ... Y_p]`` is ``Shard(-1)``.
    ``nn.Embedding``: the embedding dim is split, ``E = [E_1 ... E_p]`` (``Shard(1)``),
    ``Y_r = E_r[ids]``.

    Cost per call, input ``Replicate`` (default): forward none; backward one all-reduce of
    ``dX = sum_r dY_r W_r`` (Linear; none for Embedding, ids have no gradient). With
    ``input_layouts=Shard(1)`` (sequence parallel) the forward all-gathers ``X`` and the
    backward reduce-scatters ``dX`` instead. ``output_layouts=Replicate()`` adds an all-gather
    of ``Y``. Defaults: ``input_layouts=Replicate()``, ``output_layouts=Shard(-1)``,
    ``use_local_output=True``, as in torch.
    """


@dataclass(frozen=True, kw_only=True)
class RowwiseParallel(ModuleParallel):
    """Split the input features: each rank computes a partial sum of the output.

    ``nn.Linear``: ``W = [W_1 ... W_p]`` (columns, ``Shard(1)``), ``X = [X_1 ... X_p]``
    (``Shard(-1)``, the output of a `ColwiseParallel` layer), ``Y = sum_r X_r W_r^T + b``
    with ``b`` ``Replicate`` and added once. ``nn.Embedding``: the vocabulary is split, see
    `vocab_parallel_embedding` (``Shard(0)``, a masked lookup, ``Y = sum_r Y_r``).

    Cost per call: forward one all-reduce of ``Y`` (``output_layouts=Replicate()``, default)
    or one reduce-scatter (``output_layouts=Shard(1)``, sequence parallel); backward none for
    ``Replicate`` output (``dX_r = dY W_r`` is local), one all-gather of ``dY`` for ``Shard(1)``
    output. Defaults: ``input_layouts=Shard(-1)`` for Linear and ``Replicate()`` for Embedding,
    ``output_layouts=Replicate()``, ``use_local_output=True``.

    Sizes need not divide ``p``: a plain local input is viewed with the global width
    ``in_features`` (torch infers ``p * local`` and fails, e.g. hidden 7 on 2 ranks).
    """
