"""The on-disk format: ``index.json`` (`Index`, read and checked, written), safetensors data
files (streaming writer, checked header reader) and byte-range reads of them. Specified in
docs/checkpoint-format.md. Reads and writes go through a storage (``_storage``); nothing here
knows where the files are.
"""

from ._file_io import (adjacent_groups, byte_view, contiguous_run, crcs_of_range, crcs_of_ranges, pread_exact,
                       pread_into, preadv_into)
from ._files import CheckpointFiles, open_checkpoint, open_folder
from ._index import (CHECKSUM_FIELD, DCP_MARKER, FORMAT_NAME, FORMAT_VERSION, INCOMPLETE_MARK, INDEX_FILE, Index, MAX_INDEX_BYTES,
                     PART_SUFFIX, SavedBox, TensorEntry, data_file_name, dcp_marker, describe_non_checkpoint, dtype_from_name, dtype_name,
                     format_index, index_checksum, index_to_json, own_names, part_file_name, part_to_json,
                     plain_file_name, pointer_at, pointer_bytes, read_index, VERSION_MARK)
from ._safetensors_io import DTYPE_CODES, Entry, Header, StreamingWriter, read_header, tensor_bytes

__all__ = ["CHECKSUM_FIELD", "DCP_MARKER", "CheckpointFiles", "dcp_marker", "adjacent_groups", "byte_view", "contiguous_run", "crcs_of_range",
           "crcs_of_ranges", "open_checkpoint", "open_folder", "pread_exact", "pread_into", "preadv_into",
           "DTYPE_CODES", "Entry", "FORMAT_NAME", "FORMAT_VERSION", "Header", "INCOMPLETE_MARK", "INDEX_FILE",
           "MAX_INDEX_BYTES", "PART_SUFFIX", "Index", "SavedBox", "StreamingWriter", "TensorEntry", "data_file_name",
           "describe_non_checkpoint", "dtype_from_name", "dtype_name", "format_index", "index_checksum",
           "index_to_json", "own_names", "part_file_name", "part_to_json", "plain_file_name", "pointer_at", "pointer_bytes", "read_header", "read_index", "tensor_bytes",
           "VERSION_MARK"]
