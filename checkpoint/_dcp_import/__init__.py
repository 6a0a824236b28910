"""``import_dcp`` / ``shardwise-checkpoint import-dcp``: torch DCP checkpoints to shardwise ones.

A torch DCP directory (``.metadata`` + ``__<rank>_<k>.distcp``) becomes a verified shardwise
checkpoint, streamed a slab at a time, without importing torch's DCP package and without
running code from the files.

| module | one line |
| --- | --- |
| `_unpickle.py` | a pickle reader whose globals come only from an allowlist of our own objects |
| `_metadata.py` | ``.metadata``: look-alikes of DCP's metadata classes, checked into `DcpCheckpoint` |
| `_records.py` | the ``torch.save`` records in a ``.distcp`` file: where a chunk's bytes are; plain values |
| `_keys.py` | DCP's flat keys to shardwise's, through the nested state dict that was saved |
| `_source.py` | the source directory checked, its data files opened and their byte ranges checked |
| `_convert.py` | `import_dcp`: check the source, copy every chunk into safetensors boxes, commit, verify |
| `_cli.py` | the ``import-dcp`` subcommand |
"""

from ._cli import add_import_dcp
from ._convert import ImportStats, import_dcp

__all__ = ["ImportStats", "add_import_dcp", "import_dcp"]
