"""Every torch private name the checkpoint package uses, and nothing else.

shardwise is built on torch's public ``DTensor`` API. One placement it must recognise has no
public name: ``_StridedShard``, which FSDP applied over a tensor-parallel shard produces. The
checkpoint code needs two facts about it, and this module is the only place that touches it:

- ``isinstance(p, _StridedShard)`` tells such a placement apart (`is_strided_shard`);
- ``_StridedShard(dim, split_factor=k)`` has attributes ``.dim`` and ``.split_factor``
  (`strided_split_factor`), and a rank's local shard on a mesh axis of size ``m`` is: cut the
  held indices of ``dim`` into ``k`` pieces, each piece into ``m``, and concatenate piece
  ``r`` of each (torch.chunk semantics at both levels; `_boxes.strided_positions` computes it
  with shardwise's own arithmetic).

The state-dict helpers also recognise a ``torch.compile``d module (``OptimizedModule``, whose
module sits under ``_orig_mod``), to drop that part of its names as torch's DCP does
(`is_compiled_module`).

``tests/test_checkpoint_compat.py`` states each of these facts as a test against the
installed torch, so a torch release that changes one fails there, loudly, rather than
in a checkpoint saved with wrong boxes.
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
