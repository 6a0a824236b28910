"""Every torch private name the checkpoint package uses, and nothing else.

``_StridedShard`` (FSDP over a tensor-parallel shard) has no public name. The checkpoint code
relies on: ``isinstance(p, _StridedShard)`` (`is_strided_shard`); its ``.dim`` and
``.split_factor`` (`strided_split_factor`); and its layout (cut the held indices of ``dim`` into
``k`` pieces, each into the axis size ``m``, concatenate piece ``r`` of each, torch.chunk
semantics at both levels; `_boxes.strided_positions` computes it with shardwise's arithmetic).
A ``torch.compile``d module (``OptimizedModule``, module under ``_orig_mod``) is recognised to
drop that part of its names as torch's DCP does (`is_compiled_module`).

``tests/test_checkpoint_compat.py`` tests each fact against the installed torch.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["is_compiled_module", "is_strided_shard", "strided_split_factor", "StridedShard"]

StridedShard = _StridedShard  # the type itself, for tests and error messages


def is_strided_shard(p: Any) -> bool:
    """Whether the placement ``p`` is a ``_StridedShard``."""
    return isinstance(p, _StridedShard)


def strided_split_factor(p: Any) -> int:
    """The ``split_factor`` of the ``_StridedShard`` ``p`` as a Python int."""
    return int(p.split_factor)


def is_compiled_module(m: Any) -> bool:
    """Whether ``m`` is what ``torch.compile(module)`` returns (its module is ``m._orig_mod``)."""
    from torch._dynamo.eval_frame import OptimizedModule  # late: importing dynamo is slow
    return isinstance(m, OptimizedModule)
