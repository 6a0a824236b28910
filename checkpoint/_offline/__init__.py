"""Offline tools (one process, no torch.distributed): verify, merge, reshard.

| module | one line |
| --- | --- |
| `_verify.py` | `verify_checkpoint`: every size, header, tiling and checksum of a checkpoint |
| `_copy.py` | the slab-by-slab copy into new safetensors files and the commit of the output |
| `_merge.py` | `merge_checkpoint` (full tensors, optionally a Hugging Face folder), `reshard_checkpoint` |
"""

from ._copy import Progress, Source, into_place, verified, write_file
from ._merge import merge_checkpoint, reshard_checkpoint
from ._verify import VerifyReport, file_problems, verify_checkpoint

__all__ = ["Progress", "Source", "VerifyReport", "file_problems", "into_place", "merge_checkpoint",
           "reshard_checkpoint", "verified", "verify_checkpoint", "write_file"]
