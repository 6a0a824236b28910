"""Host awareness: does the ``dp_shard`` x ``tp`` block of ranks fit in one host? (Pure.)

Ranks are row-major with ``tp`` innermost, so each ``dp_shard * tp`` block is consecutive
ranks, and torchrun numbers ranks host by host (``local_world_size`` each). A block stays in
one host exactly when ``local_world_size % (dp_shard * tp) == 0``; otherwise the shard and TP
collectives of some blocks cross hosts. A ``pp`` axis (outermost) changes nothing: only the
pipeline's sends between stages are meant to cross hosts. With a ``cp`` axis the block is
``dp_shard * cp * tp`` (parameters are sharded over ``dp_shard`` x ``cp``, and the cp ring
passes keys and values every attention layer).
"""

from __future__ import annotations

from ._dims import ParallelDims


class HostLayoutWarning(UserWarning):
    """The mesh shape makes ``dp_shard``/``tp`` collectives cross hosts.

    A performance hint, not an error. Silence it where cross-host sharding is intended with
    ``warnings.filterwarnings("ignore", category=HostLayoutWarning)``.
    """


def host_fit_problem(dims: ParallelDims, local_world_size: int | None) -> str | None:
    """Explain why ``dims`` makes shard/TP collectives cross hosts, or None.

    Args:
        dims: the resolved mesh sizes (``dims.world_size`` is the total).
        local_world_size: ranks per host (torchrun's ``LOCAL_WORLD_SIZE``), or None when unknown.

    Returns None (nothing to say) when ``local_world_size`` is None, when the job fits on one host
    (``world_size <= local_world_size``), when hosts are uneven (``world_size % local_world_size
    != 0``: boundaries unknown), or when the ``dp_shard * tp`` block divides ``local_world_size``.
    Otherwise returns a one-paragraph message with a suggested shape.

    Raises:
        ValueError: ``local_world_size`` is not a positive int.
    """
    if local_world_size is None:
        return None
    if isinstance(local_world_size, bool) or not isinstance(local_world_size, int) or local_world_size < 1:
        raise ValueError(f"local_world_size={local_world_size!r} is invalid; it must be a positive int (ranks per "
                         "host, torchrun's LOCAL_WORLD_SIZE) or None")
    world, local = dims.world_size, local_world_size
    if world <= local or world % local != 0:
        return None
    block = dims.dp_shard * dims.cp * dims.tp
    if local % block == 0:
        return None
    hosts = world // local
    # hosts holding one pipeline stage (pp outermost): the replicas to suggest per stage
    per_stage = hosts // dims.pp if hosts % dims.pp == 0 and hosts >= dims.pp else 1
    pp_text = f"pp={dims.pp}, " if dims.pp > 1 else ""
    cp_text = f" * cp({dims.cp})" if dims.cp > 1 else ""
    inner = dims.cp * dims.tp  # the cp x tp block that a host must hold whole
    head = (f"dp_shard({dims.dp_shard}){cp_text} * tp({dims.tp}) = {block} consecutive ranks do not fit in one host "
            f"of local_world_size({local}) ranks (world_size({world}) = {hosts} hosts), so shard/TP collectives "
            "would cross hosts over the slower inter-host network.")
    if local % inner != 0:
        divisors = [d for d in range(1, local + 1) if local % d == 0]
        what, name = (f"cp({dims.cp}) * tp({dims.tp})", "cp * tp") if dims.cp > 1 else (f"tp({dims.tp})", "tp")
        return (f"{head} {what} does not divide local_world_size({local}), so even the "
                f"{'CP/TP' if dims.cp > 1 else 'TP'} groups cross hosts: choose {name} from {divisors}, then "
                f"dp_shard = {local} // {name} and dp_replicate = {per_stage if dims.pp > 1 else hosts}.")
    return (f"{head} Consider {pp_text}dp_replicate={per_stage if dims.pp > 1 else hosts}, dp_shard={local // inner}, "
            f"{f'cp={dims.cp}, ' if dims.cp > 1 else ''}tp={dims.tp} (shard within a host, replicate across hosts), "
            "or filter HostLayoutWarning if cross-host sharding is intended.")
