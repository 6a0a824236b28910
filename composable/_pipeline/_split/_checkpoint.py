"""State dicts of a split model with the keys and layouts of the unsplit one.

[Note: checkpoints of a split model]
``save`` needs the same tensors on every rank, each piece written by one rank. So
`pipeline_state_dict` completes a rank's state with the other stages': once per split the ranks
exchange what each holds (shape, dtype, mesh ranks, placements), and a tensor held elsewhere
becomes a DTensor on a mesh of its stage's ranks that excludes this rank (``_compat.py``), so this
rank writes and reads none of it. A plain tensor is ``Replicate`` over its stage's ranks. The keys
are the unsplit model's, so the checkpoint loads into any pipeline/dp/tp layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from ._compat import mesh_without_groups
from ._stages import PipelineSplit

__all__ = ["pipeline_state_dict", "pipeline_optimizer_state_dict", "set_pipeline_state_dict",
           "set_pipeline_optimizer_state_dict"]


def _stage_ranks(split: PipelineSplit) -> list[int]:
    """The global ranks holding this rank's stage: ``split.stage_ranks``, or for a 1-D mesh that
    cannot tell, the world's ranks at this pipeline position (one all-gather)."""
    if split.stage_ranks is not None:
        return list(split.stage_ranks)
    positions: list = [None] * dist.get_world_size()
    dist.all_gather_object(positions, split.pp_rank)
    return [r for r, p in enumerate(positions) if p == split.pp_rank]


def _describe(t: torch.Tensor, stage_ranks: list[int]) -> dict:
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        return {"shape": tuple(t.shape), "stride": tuple(t.stride()), "dtype": t.dtype,
                "ranks": mesh.mesh.tolist(), "names": mesh.mesh_dim_names, "placements": tuple(t.placements),
                "device": mesh.device_type}
    return {"shape": tuple(t.shape), "stride": tuple(t.contiguous().stride()), "dtype": t.dtype,
            "ranks": list(stage_ranks), "names": ("stage",), "placements": (Replicate(),),
            "device": t.device.type}


def _as_dtensor(t: torch.Tensor | None, d: dict) -> DTensor:
    if isinstance(t, DTensor):
        return t
    mesh = mesh_without_groups(d["device"], d["ranks"], d["names"])
    if t is None:  # never read or written here; a 0-d one keeps its 0-d shape (from_local infers it)
        local = torch.zeros((), dtype=d["dtype"]) if not d["shape"] else torch.empty(0, dtype=d["dtype"])
    else:
        local = t.detach()
    return DTensor.from_local(local, mesh, d["placements"], run_check=False, shape=torch.Size(d["shape"]),
                              stride=d["stride"])


def _complete(split: PipelineSplit, mine: dict, order: Callable[[str], tuple[int, str]]) -> dict:
    """``mine`` (flat key -> tensor or value) completed with the other stages' keys."""
    stage_ranks = _stage_ranks(split)
    meta = {k: _describe(v, stage_ranks) for k, v in mine.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in mine.items() if not isinstance(v, torch.Tensor)}
    gathered: list = [None] * split.pp_size
    dist.all_gather_object(gathered, (meta, values), group=split.pp_group)
    out: dict = {}
    for peer_meta, peer_values in gathered:
        for k, d in peer_meta.items():
            out.setdefault(k, _as_dtensor(mine.get(k), d) if k in mine else _as_dtensor(None, d))
        for k, v in peer_values.items():
            out.setdefault(k, mine.get(k, v))
    return {k: out[k] for k in sorted(out, key=order)}


def _order(split: PipelineSplit) -> Callable[[str], tuple[int, str]]:
    index = {k: i for i, k in enumerate(split.fqns)}
    return lambda k: (index.get(k.split("/")[0], len(index)), k)


def pipeline_state_dict(split: PipelineSplit) -> dict:
    """The model state of the unsplit model, by FQN, for ``shardwise.checkpoint.save``/``load``
    on every rank (collective on the ``pp`` group). Loading into it fills this rank's
    parameters in place; see [Note: checkpoints of a split model]."""
    return _complete(split, split.module.state_dict(), _order(split))


def set_pipeline_state_dict(split: PipelineSplit, state: dict) -> None:
    """Copy a loaded `pipeline_state_dict` (or a full plain one) into this rank's tensors."""
    own = split.module.state_dict()
    with torch.no_grad():
        for k, dst in own.items():
            src = state[k]
            if isinstance(src, DTensor) and not isinstance(dst, DTensor):
                src = src.to_local()
            if src is not dst and src.data_ptr() != dst.data_ptr():
                dst.copy_(src)


def pipeline_optimizer_state_dict(split: PipelineSplit, optim: torch.optim.Optimizer) -> dict:
    """The optimizer state keyed like ``shardwise.checkpoint.get_optimizer_state_dict`` of the
    unsplit model (``{"state": {fqn: {...}}, "param_groups": [...]}``), completed with the other
    stages' entries; ``param_groups`` list every FQN of the unsplit model."""
    from shardwise.checkpoint import get_optimizer_state_dict  # the checkpoint package, not a torch API

    osd = get_optimizer_state_dict(split.module, optim)
    flat = {f"{fqn}/{name}": v for fqn, st in osd["state"].items() for name, v in st.items()}
    full = _complete(split, flat, _order(split))
    state: dict = {}
    for k, v in full.items():
        fqn, name = k.split("/", 1)
        state.setdefault(fqn, {})[name] = v
    params = [n for n in split.fqns if n in state]
    groups = [dict(g, params=params) for g in osd["param_groups"][:1]]
    if len(osd["param_groups"]) != 1:
        raise ValueError("pipeline_optimizer_state_dict: one parameter group is supported; got "
                         f"{len(osd['param_groups'])}")
    return {"state": state, "param_groups": groups}


def set_pipeline_optimizer_state_dict(split: PipelineSplit, optim: torch.optim.Optimizer, osd: dict) -> None:
    """Put a loaded `pipeline_optimizer_state_dict` back into ``optim`` (this rank's entries)."""
    from shardwise.checkpoint import set_optimizer_state_dict

    mine = {n for n, _ in split.module.named_parameters()}
    state = {}
    for fqn, st in osd["state"].items():
        if fqn in mine:
            state[fqn] = {k: (v.to_local() if isinstance(v, DTensor) and v.device_mesh.mesh_dim_names == ("stage",)
                              else v) for k, v in st.items()}
    groups = [dict(g, params=[n for n in g["params"] if n in mine]) for g in osd["param_groups"]]
    set_optimizer_state_dict(split.module, optim, {"state": state, "param_groups": groups})
