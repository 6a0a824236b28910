"""The base of ``checkpoint/``: what every other room may use, importing nothing of the package.

| module | one line |
| --- | --- |
| `_errors.py` | `CheckpointError`, the one exception type of the package |
| `_checksums.py` | CRC-32 arithmetic and checksum chunks ([Note: checksum chunks]) |
| `_json_strict.py` | JSON parsing that refuses duplicate keys and non-finite numbers |
| `_compat.py` | the torch private APIs the package relies on, each with a test |
| `_comm.py` | cross-rank agreement and small JSON collectives |
| `_trace.py` | profiler ranges named ``shardwise.checkpoint.<phase>`` |
"""

from ._checksums import (BoxChecksums, ChunkRule, ChunkedCrc, box_rows, chunk_count, combine_chunks, crcs_from_hex,
                         crcs_to_hex, default_chunk_rule)
from ._comm import (agree, all_gather_json, alone, broadcast_json, collective_device, gather_json, is_distributed,
                    rank_and_world, scatter_json)
from ._compat import is_strided_shard, strided_split_factor
from ._errors import CheckpointError
from ._json_strict import DuplicateKey, parse_json_strict
from ._trace import phase

__all__ = ["BoxChecksums", "CheckpointError", "ChunkRule", "ChunkedCrc", "DuplicateKey", "agree", "all_gather_json",
           "alone", "box_rows", "broadcast_json", "chunk_count", "collective_device", "combine_chunks",
           "crcs_from_hex", "crcs_to_hex", "default_chunk_rule", "gather_json", "is_distributed", "is_strided_shard",
           "parse_json_strict", "phase", "rank_and_world", "scatter_json", "strided_split_factor"]
