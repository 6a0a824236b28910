"""Run a real client (torchtitan, Lightning) on shardwise: torch's public names rebound.

`rebind_to_shardwise()` is the import hook a user would put at the top of a training script:
after it, ``from torch.distributed.fsdp import fully_shard``,
``torch.distributed.tensor.parallel.loss_parallel()`` and ``import torch.distributed.checkpoint
as dcp; dcp.save(...)`` reach shardwise's implementations, whichever form the client uses (a
module attribute looked up at call time, or a name imported once).

How: each module of `REBIND` is replaced, in ``sys.modules`` and as an attribute of its parent
package, by a copy of torch's module (a new module object with the same ``__dict__``, so
``__path__`` and the submodules stay reachable) in which every name that shardwise's module also
exports (its ``__all__``) is shardwise's. Names only torch has (``FullyShardedDataParallel``,
``HuggingFaceStorageWriter``, ``Stateful``...) stay torch's. torch's own modules are not
modified: code that bound torch's names before the hook keeps them, which is why the hook must
run before the client is imported (it refuses otherwise), in every rank. Differential tests
import a client only inside their rank bodies (never at a test module's top level, which the
forkserver preloads), so the torch run and the shardwise run each import it fresh.
"""

from __future__ import annotations

import importlib
import sys
import types

# torch's module -> shardwise's module whose same-named public names replace torch's
REBIND: dict[str, str] = {
    "torch.distributed.fsdp": "shardwise.composable",
    "torch.distributed._composable.fsdp": "shardwise.composable",
    "torch.distributed.tensor.parallel": "shardwise.composable",
    # the submodules the package re-exports from: code (torch's own tests among it) that imports
    # ``from torch.distributed.tensor.parallel.style import ColwiseParallel`` gets shardwise's too
    "torch.distributed.tensor.parallel.api": "shardwise.composable",
    "torch.distributed.tensor.parallel.style": "shardwise.composable",
    "torch.distributed.tensor.parallel.loss": "shardwise.composable",
    "torch.distributed.checkpoint": "shardwise.checkpoint",
    "torch.distributed.checkpoint.state_dict": "shardwise.checkpoint",
    "torch.distributed.checkpoint.state_dict_saver": "shardwise.checkpoint",
    "torch.distributed.checkpoint.state_dict_loader": "shardwise.checkpoint",
}

MARK = "__shardwise_rebound__"
TORCH = "__shardwise_torch_module__"  # on a rebound module: torch's own module it stands in for


def rebind_to_shardwise(clients: tuple[str, ...] = ("torchtitan", "lightning", "pytorch_lightning")
                        ) -> dict[str, list[str]]:
    """Rebind torch's FSDP2 / TP / DCP names to shardwise's in this process (idempotent).

    Refuses (``RuntimeError``) when one of ``clients`` is already imported: it would keep torch's
    names. Returns ``{torch module: [names now shardwise's]}``."""
    early = sorted(m for m in sys.modules if m.split(".")[0] in clients)
    if early:
        raise RuntimeError(f"rebind_to_shardwise() after the client was imported ({early[:3]}...): "
                           "it would keep torch's names; call it first")
    out = {}
    for name, target in REBIND.items():
        current = importlib.import_module(name)
        if getattr(current, MARK, None) is not None:
            out[name] = list(getattr(current, MARK))
            continue
        sw = importlib.import_module(target)
        shim = types.ModuleType(name, current.__doc__)
        shim.__dict__.update(current.__dict__)
        names = sorted(n for n in sw.__all__ if n in current.__dict__)
        for n in names:
            setattr(shim, n, getattr(sw, n))
        setattr(shim, MARK, names)
        setattr(shim, TORCH, current)
        sys.modules[name] = shim
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, shim)
        out[name] = names
    return out


def rebound() -> bool:
    """Whether `rebind_to_shardwise` ran in this process."""
    return getattr(sys.modules.get("torch.distributed.fsdp"), MARK, None) is not None


def use(impl: str) -> None:
    """In a rank body: ``"torch"`` leaves torch's names (and checks nothing rebound them);
    ``"shardwise"`` rebinds them."""
    if impl == "shardwise":
        rebind_to_shardwise()
    elif impl == "torch":
        assert not rebound(), "torch's names were rebound in this process"
    else:
        raise ValueError(f"unknown implementation {impl!r}")


def _torch_fsdp_module_class() -> type:
    """torch's own ``FSDPModule``, also after the rebind (the rebound module keeps torch's)."""
    fsdp = importlib.import_module("torch.distributed.fsdp")
    return getattr(fsdp, TORCH, fsdp).FSDPModule


def _hook_origins(hook, depth: int = 3) -> set[str]:
    """The modules that define a forward hook and what it calls through its closure: a function,
    a closure, a bound method or a ``functools.partial`` of one (torch's ``distribute_module``
    registers a lambda of its own around the style's ``_prepare_input_fn``)."""
    out: set[str] = set()
    while hasattr(hook, "func"):  # functools.partial
        hook = hook.func
    hook = getattr(hook, "__func__", hook)  # a bound method
    out.add(getattr(hook, "__module__", "") or "")
    if depth > 0:
        for cell in getattr(hook, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(value) and not isinstance(value, type):
                out |= _hook_origins(value, depth - 1)
    return out


def implementations(model) -> dict[str, set[str]]:
    """What sharded ``model``, seen from inside the rank: ``{"fsdp": {...}, "tp": {...}}`` with
    ``"torch"`` / ``"shardwise"`` for each kind of unit found. FSDP: the class of every module that
    `fully_shard` turned into a unit (shardwise's ``FSDPModule`` or torch's own). TP: the module
    that defines each forward hook a parallel style registered (torch's
    ``torch.distributed.tensor.parallel`` or shardwise's)."""
    from shardwise.composable import FSDPModule as SWUnit

    torch_unit = _torch_fsdp_module_class()
    out: dict[str, set[str]] = {"fsdp": set(), "tp": set()}
    for m in model.modules():
        if isinstance(m, SWUnit):
            out["fsdp"].add("shardwise")
        elif isinstance(m, torch_unit):
            out["fsdp"].add("torch")
        for hook in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]:
            for origin in _hook_origins(hook):
                if origin.startswith("torch.distributed.tensor.parallel"):
                    out["tp"].add("torch")
                elif origin.startswith("shardwise.composable._tp"):
                    out["tp"].add("shardwise")
    return out


def assert_ran(impl: str, model, tp: bool = False) -> dict[str, list[str]]:
    """In a rank body, after the client sharded ``model``: every FSDP unit (and, with ``tp``,
    every TP hook) is ``impl``'s, and there is at least one of each. A rebind that silently
    failed (torch's names still bound in the client) fails here instead of comparing torch with
    torch. Returns what was seen (for the caller's record)."""
    seen = implementations(model)
    want = {"fsdp": {impl}, "tp": {impl} if tp else set()}
    assert seen == want, (f"the client sharded the model with {seen} (want {want}): "
                          f"{'the rebind to shardwise did not reach it' if impl == 'shardwise' else 'torch run rebound'}")
    return {k: sorted(v) for k, v in seen.items()}
