"""The bytes of one message between pipeline ranks: a header of 12 int64s, then the tensor
([Note: messages between stages] in ``_p2p.py``). Header: ``status`` (`DATA`: the tensor follows in
the same message; `ERROR`: a text follows; `NEW_SHAPE`: the header carries a new shape, the tensor
comes as a second message), the dtype's code in `DTYPES`, ndim, sizes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["CODE", "DATA", "DTYPES", "ERROR", "HEADER", "HEADER_BYTES", "NEW_SHAPE", "check_sendable", "header",
           "nbytes"]

HEADER = 12
HEADER_BYTES = HEADER * 8
DATA, ERROR, NEW_SHAPE = 0, 1, 2
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
CODE = {d: i for i, d in enumerate(DTYPES)}


def nbytes(meta: tuple[torch.dtype, Sequence[int]] | None) -> int:
    """Bytes of a tensor of ``meta = (dtype, shape)``; 0 for None (nothing known yet)."""
    if meta is None:
        return 0
    dtype, shape = meta
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


def header(status: int, code: int, sizes: Sequence[int]) -> torch.Tensor:
    """A header as bytes."""
    h = [status, code, len(sizes), *sizes]
    return torch.tensor(h + [0] * (HEADER - len(h)), dtype=torch.int64).view(torch.uint8)


def check_sendable(t: torch.Tensor) -> torch.Tensor:
    """``t``, if a header can describe it; a ValueError naming the limit otherwise."""
    if t.dim() > HEADER - 3:
        raise ValueError(f"pipeline: an activation of {t.dim()} dims cannot be sent (at most {HEADER - 3})")
    if t.dtype not in CODE:
        raise ValueError(f"pipeline: activations of dtype {t.dtype} cannot be sent between stages")
    return t
