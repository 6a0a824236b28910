"""``import_dcp`` / ``shardwise-checkpoint import-dcp``: a torch DCP directory to a verified shardwise
checkpoint, streamed, without importing torch's DCP package or running code from the files."""

from ._cli import add_import_dcp
from ._convert import ImportStats, import_dcp

__all__ = ["ImportStats", "add_import_dcp", "import_dcp"]
