"""``import_dcp`` / ``shardwise-checkpoint import-dcp``: torch DCP checkpoints to shardwise ones.

A torch DCP directory (``.metadata`` + ``__<rank>_<k>.distcp``) becomes a verified shardwise
checkpoint, streamed a slab at a time, without importing torch's DCP package and without
running code from the files.
"""

from ._cli import add_import_dcp
from ._convert import ImportStats, import_dcp

__all__ = ["ImportStats", "add_import_dcp", "import_dcp"]
