"""Offline tools (one process, no torch.distributed): verify, merge, reshard."""

from ._copy import Progress, Source, into_place, verified, write_file
from ._merge import merge_checkpoint, reshard_checkpoint
from ._verify import VerifyReport, file_problems, verify_checkpoint

__all__ = ["Progress", "Source", "VerifyReport", "file_problems", "into_place", "merge_checkpoint",
           "reshard_checkpoint", "verified", "verify_checkpoint", "write_file"]
