"""The base of ``checkpoint/``: what every other room may use, importing nothing of the package."""

from ._checksums import (BoxChecksums, ChunkRule, ChunkedCrc, box_rows, chunk_count, combine_chunks, crcs_from_hex,
                         crcs_to_hex, default_chunk_rule)
from ._comm import (agree, agree_values, all_gather_json, alone, broadcast_json, collective_device, gather_json, is_distributed,
                    rank_and_world, scatter_json, sum_ints, world_group)
from ._compat import is_compiled_module, is_strided_shard, strided_split_factor
from ._errors import CheckpointError, IndexMissing
from ._json_strict import DuplicateKey, parse_json_strict
from ._trace import phase

__all__ = ["BoxChecksums", "CheckpointError", "ChunkRule", "ChunkedCrc", "DuplicateKey", "agree", "agree_values", "all_gather_json",
           "alone", "box_rows", "broadcast_json", "chunk_count", "collective_device", "combine_chunks",
           "crcs_from_hex", "crcs_to_hex", "default_chunk_rule", "gather_json", "IndexMissing", "is_compiled_module",
           "is_distributed", "is_strided_shard", "parse_json_strict", "phase", "rank_and_world", "scatter_json",
           "strided_split_factor", "sum_ints", "world_group"]
