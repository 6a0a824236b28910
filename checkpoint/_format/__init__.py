"""The on-disk format: ``index.json`` (`Index`, read and checked, written), safetensors data
files (streaming writer, checked header reader) and byte-range reads of them. Specified in
docs/checkpoint-format.md. Reads and writes go through a storage (``_storage``); nothing here
knows where the files are.

| module | one line |
| --- | --- |
| `_file_io.py` | byte ranges of an open data file into tensors, CRC-32s of ranges |
| `_safetensors_io.py` | the safetensors layout: streaming writer, checked header reader |
| `_index_model.py` | the index's records `Index`/`TensorEntry`/`SavedBox` and the format's names |
| `_index.py` | `index.json` read and checked, written |
"""

from ._index import (CHECKSUM_FIELD, FORMAT_NAME, FORMAT_VERSION, INCOMPLETE_MARK, INDEX_FILE, MAX_INDEX_BYTES, Index,
                     SavedBox, TensorEntry, data_file_name, describe_non_checkpoint, dtype_from_name, dtype_name,
                     format_index, index_checksum, index_to_json, plain_file_name, read_index)
from ._safetensors_io import DTYPE_CODES, Entry, Header, StreamingWriter, read_header, tensor_bytes

__all__ = ["CHECKSUM_FIELD", "DTYPE_CODES", "Entry", "FORMAT_NAME", "FORMAT_VERSION", "Header", "INCOMPLETE_MARK",
           "INDEX_FILE", "MAX_INDEX_BYTES", "Index", "SavedBox", "StreamingWriter", "TensorEntry", "data_file_name",
           "describe_non_checkpoint", "dtype_from_name", "dtype_name", "format_index", "index_checksum",
           "index_to_json", "plain_file_name", "read_header", "read_index", "tensor_bytes"]
