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
