"""The zigzag (head-tail) sequence layout of context parallelism, and the helpers that shard
tokens, targets, position ids and masks into it and gather outputs back.

[Note: the zigzag layout]
A sequence of ``T`` tokens (a multiple of ``2 * cp``) is cut into ``2 * cp`` chunks; rank ``r``
holds chunks ``r`` and ``2cp - 1 - r``, in that order. Under a causal mask every rank then does
the same ``2cp + 1`` chunk pairs of work, so no rank waits for another in the ring.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._mesh_utils import all_gather_single

__all__ = ["zigzag_chunks", "zigzag_positions", "shard_sequence", "unshard_sequence", "block_plan"]


def zigzag_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two global chunk indices (of ``2 * cp``) that cp rank ``rank`` holds, in local order:
    ``(rank, 2 * cp - 1 - rank)``."""
    if not isinstance(cp, int) or cp < 1 or not isinstance(rank, int) or not 0 <= rank < cp:
        raise ValueError(f"zigzag_chunks: rank={rank!r} must be in [0, cp={cp!r}) with cp a positive int")
    return rank, 2 * cp - 1 - rank


def _check_len(seq_len: int, cp: int, what: str) -> int:
    if seq_len % (2 * cp):
        raise ValueError(f"{what}: sequence length {seq_len} is not a multiple of 2 * cp = {2 * cp} (the zigzag "
                         f"layout cuts it into 2 * cp equal chunks); pad the sequence to a multiple of {2 * cp}")
    return seq_len // (2 * cp)


def zigzag_positions(seq_len: int, rank: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions (int64 ``[seq_len / cp]``) of the tokens cp rank ``rank`` holds, in
    local order: what ``position_ids`` (and rotary tables) must be indexed by on that rank."""
    a, b = zigzag_chunks(rank, cp)
    n = _check_len(seq_len, cp, "zigzag_positions")
    ar = torch.arange(n, device=device)
    return torch.cat((ar + a * n, ar + b * n))


def shard_sequence(tensor: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's zigzag shard of ``tensor`` along ``dim`` (default 1: ``[B, T, ...]``):
    chunks ``rank`` and ``2cp - 1 - rank`` of ``2cp``, concatenated (a new tensor). Use it the
    same way on tokens, targets, ``position_ids`` and masks (a ``[B, T]`` padding mask along
    dim 1; a ``[T]`` tensor with ``dim=0``)."""
    a, b = zigzag_chunks(rank, cp)
    dim = dim % tensor.ndim
    n = _check_len(tensor.shape[dim], cp, "shard_sequence")
    return torch.cat((tensor.narrow(dim, a * n, n), tensor.narrow(dim, b * n, n)), dim=dim)


def unshard_sequence(local: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1) -> torch.Tensor:
    """The global sequence from every cp rank's zigzag shard ``local`` (collective over the cp
    ``group``, every rank gets the whole tensor, in global order). Not differentiable: for
    outputs one reads, such as logits or predictions to print or compare."""
    cp = dist.get_world_size(group)
    dim = dim % local.ndim
    if local.shape[dim] % 2:
        raise ValueError(f"unshard_sequence: the local length {local.shape[dim]} along dim {dim} is odd; a zigzag "
                         "shard holds two equal chunks")
    moved = local.movedim(dim, 0).contiguous()
    out = torch.empty(cp * moved.numel(), dtype=moved.dtype, device=moved.device)
    all_gather_single(out, moved.view(-1), group=group)
    out = out.view(cp, *moved.shape)
    n = moved.shape[0] // 2
    chunks: list[torch.Tensor] = [torch.empty(0)] * (2 * cp)
    for r in range(cp):
        a, b = zigzag_chunks(r, cp)
        chunks[a], chunks[b] = out[r, :n], out[r, n:]
    return torch.cat(chunks, dim=0).movedim(0, dim)


Selection = int | None
"""Which half of a local zigzag shard a block uses: ``0`` (its first chunk), ``1`` (its second),
``None`` (both, the whole shard)."""


def block_plan(q_chunks: tuple[int, int], kv_chunks: tuple[int, int],
               causal: bool) -> list[tuple[Selection, Selection, bool]]:
    """The attention blocks between a query shard holding global chunks ``q_chunks`` and a key
    shard holding ``kv_chunks``: ``(query half, key half, diagonal)`` triples. Without a causal
    mask one block; with it query chunk ``i`` sees key chunk ``j < i`` fully, ``j == i`` masked
    (``diagonal=True``), ``j > i`` not at all. Full blocks sharing keys, or covering both key
    halves, merge, so a ring step does at most three matmul pairs instead of four."""
    if not causal:
        return [(None, None, False)]
    full: list[list[int]] = [[], []]
    plan: list[tuple[Selection, Selection, bool]] = []
    diag: list[tuple[Selection, Selection, bool]] = []
    for qi, qc in enumerate(q_chunks):
        for ki, kc in enumerate(kv_chunks):
            if kc < qc:
                full[qi].append(ki)
            elif kc == qc:
                diag.append((qi, ki, True))

    def keys(halves: list[int]) -> Selection:
        return None if len(halves) == 2 else halves[0]

    if full[0] and full[0] == full[1]:
        plan.append((None, keys(full[0]), False))
    else:
        plan += [(qi, keys(f), False) for qi, f in enumerate(full) if f]
    return plan + diag
