"""A torch DCP checkpoint's ``.metadata``, read without torch's DCP package and without running
code from the file.

torch 2.13's ``FileSystemWriter`` pickles (protocol 4) one ``Metadata`` (of DCP's ``metadata``
module, `DCP_PACKAGE`): ``state_dict_metadata`` ``{flat key: TensorStorageMetadata |
BytesStorageMetadata}`` (a tensor's ``properties``, pickled as a tuple with the layout via
``torch.serialization._get_layout`` and a ``_MEM_FORMAT_ENCODING``; its global ``size``; one
``ChunkStorageMetadata(offsets, sizes)`` per saved piece); ``storage_data`` ``{MetadataIndex(fqn,
offset): _StorageInfo(relative_path, offset, length[, transform_descriptors])}``, the byte range
of each entry in a ``__<rank>_<k>.distcp`` file; ``planner_data`` ``{flat key: path in the nested
state}``; ``storage_meta`` and ``version``. `read_dcp_metadata` unpickles it with
`_unpickle.safe_loads`, each name mapped to a look-alike here or a checking function ([Note:
reading a pickle without running it]), checks every field and returns a `DcpCheckpoint`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._base import CheckpointError
from .._format import plain_file_name
from .._storage import Storage
from ._unpickle import Call, safe_loads

__all__ = ["METADATA_FILE", "DcpBytes", "DcpCheckpoint", "DcpChunk", "DcpTensor", "read_dcp_metadata"]

METADATA_FILE = ".metadata"
MAX_METADATA_BYTES = 4 << 30


class _LookAlike:
    """A stand-in for a DCP metadata class: ``BUILD`` fills only the known ``FIELDS`` (later
    torch's extra keys ignored; absent ones keep their defaults, as DCP's dataclasses do)."""

    FIELDS: dict[str, Any] = {}

    def __init__(self) -> None:
        for k, v in self.FIELDS.items():
            setattr(self, k, v)

    def __getattr__(self, name: str) -> Any:  # fields are set by __init__ / BUILD; typed loosely
        raise AttributeError(name)

    def __setstate__(self, state: Any) -> None:
        self.__init__()  # type: ignore[misc]  # NEWOBJ ran only __new__
        if isinstance(state, tuple) and len(state) == 2 and state[1] is None:
            state = state[0]
        if not isinstance(state, dict):
            raise CheckpointError(f"a {type(self).__name__[1:]} in the metadata has state of type "
                                  f"{type(state).__name__}, not a dict")
        for k in self.FIELDS:
            if k in state:
                setattr(self, k, state[k])


def _look_alike(name: str, *fields: str) -> type[_LookAlike]:
    return type(name, (_LookAlike,), {"FIELDS": dict.fromkeys(fields)})


_Metadata = _look_alike("_Metadata", "state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
_TensorStorageMetadata = _look_alike("_TensorStorageMetadata", "properties", "size", "chunks")
_BytesStorageMetadata = _look_alike("_BytesStorageMetadata")
_ChunkStorageMetadata = _look_alike("_ChunkStorageMetadata", "offsets", "sizes")
_StorageMeta = _look_alike("_StorageMeta", "checkpoint_id", "save_id", "load_id", "modules")
_StorageInfo = _look_alike("_StorageInfo", "relative_path", "offset", "length", "transform_descriptors")


class _TensorProperties(_LookAlike):
    """Pickled as the tuple ``(dtype, layout, requires_grad, memory format, pin_memory)``."""

    FIELDS = {"dtype": None, "layout": None, "requires_grad": False, "memory_format": 0, "pin_memory": False}

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 5:
            self.__init__()  # type: ignore[misc]
            self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state
            return
        super().__setstate__(state)


class _MetadataIndex(_LookAlike):
    """Hashed and compared by ``(fqn, offset)``, as DCP's (``index`` is only a hint)."""

    FIELDS = {"fqn": None, "offset": None, "index": None}

    def _key(self) -> tuple:
        return (self.fqn, self.offset)

    def __hash__(self) -> int:
        if not isinstance(self.fqn, str) or not (self.offset is None or isinstance(self.offset, tuple)):
            raise CheckpointError("a MetadataIndex in the metadata has an fqn that is not a str or an offset that "
                                  "is not a torch.Size")
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _MetadataIndex) and self._key() == other._key()


def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise CheckpointError(f"expected an integer, got {type(v).__name__}")
    return v


def _size(*args: Any) -> tuple[int, ...]:
    """``torch.Size(sequence)``: a tuple of ints."""
    if len(args) > 1 or (args and not isinstance(args[0], (tuple, list))):
        raise CheckpointError("a torch.Size in the metadata is not built from a sequence of integers")
    return tuple(_int(v) for v in (args[0] if args else ()))


def _layout(name: Any) -> str:
    if name not in ("torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch._mkldnn"):
        raise CheckpointError(f"unknown tensor layout {str(name)[:40]!r} in the metadata")
    return str(name)


def _mem_format(value: Any) -> int:
    if value not in (0, 1, 2):
        raise CheckpointError(f"unknown memory format code {str(value)[:20]!r} in the metadata")
    return int(value)


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise CheckpointError("a path in the metadata is not built from strings")
    return "/".join(parts)


DTYPES: dict[str, torch.dtype] = {n: d for n in dir(torch) if isinstance(d := getattr(torch, n), torch.dtype)}

# The module path DCP's pickles name their classes by: matched as data by the restricted
# unpickler, never imported (tests/test_dcp_import.py checks that in a subprocess).
DCP_PACKAGE = "torch.distributed.checkpoint"
_META = f"{DCP_PACKAGE}.metadata"
ALLOWED: dict[tuple[str, str], Any] = {
    (_META, "Metadata"): _Metadata,
    (_META, "TensorStorageMetadata"): _TensorStorageMetadata,
    (_META, "BytesStorageMetadata"): _BytesStorageMetadata,
    (_META, "ChunkStorageMetadata"): _ChunkStorageMetadata,
    (_META, "TensorProperties"): _TensorProperties,
    (_META, "MetadataIndex"): _MetadataIndex,
    (_META, "StorageMeta"): _StorageMeta,
    (_META, "_MEM_FORMAT_ENCODING"): Call(_mem_format),
    (f"{DCP_PACKAGE}.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): Call(_size),
    ("torch.serialization", "_get_layout"): Call(_layout),
    **{("pathlib", n): Call(_path) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")},
    **{("torch", n): d for n, d in DTYPES.items()},
}


@dataclass(frozen=True)
class DcpChunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the DCP directory
    offset: int  # byte range of the chunk's torch.save record in ``file``
    length: int


@dataclass(frozen=True)
class DcpTensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]  # non-empty chunks only, each once


@dataclass(frozen=True)
class DcpBytes:
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpCheckpoint:
    tensors: dict[str, DcpTensor]
    values: dict[str, DcpBytes]
    paths: dict[str, tuple[str | int, ...]]  # flat key -> its path in the saved state dict
    version: str | None


def _storage(info: Any, what: str) -> tuple[str, int, int]:
    if not isinstance(info, _StorageInfo):
        raise CheckpointError(f"{what}: its storage entry is a {type(info).__name__}, not a _StorageInfo")
    name = info.relative_path
    if not plain_file_name(name):
        raise CheckpointError(f"{what}: its file {str(name)[:60]!r} is not a plain file name inside the checkpoint "
                              "directory (absolute, '..', a sub-directory or hidden); refusing to read it")
    offset, length = _int(info.offset), _int(info.length)
    if offset < 0 or length < 0:
        raise CheckpointError(f"{what}: negative byte offset or length")
    transforms = info.transform_descriptors
    if transforms:
        raise CheckpointError(f"{what}: saved through the DCP storage extensions {list(transforms)[:4]} (e.g. "
                              "compression), which import-dcp does not read; load it with torch DCP and save it "
                              "without extensions, or with shardwise.checkpoint.save")
    return name, offset, length


def _tensor(key: str, md: _LookAlike, storage: dict, where: str) -> DcpTensor:
    what = f"{where}: tensor '{key}'"
    props = md.properties
    dtype = getattr(props, "dtype", None)
    if not isinstance(props, _TensorProperties) or not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{what} has no dtype in its properties")
    if getattr(props, "layout", "torch.strided") not in (None, "torch.strided"):
        raise CheckpointError(f"{what} has layout {props.layout} (only dense tensors are supported)")
    shape = md.size
    if not isinstance(shape, tuple) or any(s < 0 for s in shape):
        raise CheckpointError(f"{what} has no valid size")
    if not isinstance(md.chunks, list):
        raise CheckpointError(f"{what} has no list of chunks")
    chunks: dict[tuple[int, ...], DcpChunk] = {}
    for c in md.chunks:
        offs, sizes = getattr(c, "offsets", None), getattr(c, "sizes", None)
        if not isinstance(c, _ChunkStorageMetadata) or not isinstance(offs, tuple) or not isinstance(sizes, tuple):
            raise CheckpointError(f"{what} has a chunk without offsets and sizes")
        if len(offs) != len(shape) or len(sizes) != len(shape) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(offs, sizes, shape)):
            raise CheckpointError(f"{what} has a chunk at {list(offs)} of size {list(sizes)} outside its shape "
                                  f"{list(shape)}")
        if any(n == 0 for n in sizes) or offs in chunks:
            continue  # an empty shard holds nothing; a chunk listed twice is one chunk
        info = storage.get(("tensor", key, offs))
        if info is None:
            raise CheckpointError(f"{what}: the chunk at {list(offs)} has no entry in storage_data; the metadata is "
                                  "damaged")
        chunks[offs] = DcpChunk(offs, sizes, *_storage(info, f"{what} chunk at {list(offs)}"))
    return DcpTensor(dtype, shape, tuple(chunks.values()))


def _paths(planner_data: Any, keys: list[str], where: str) -> dict[str, tuple[str | int, ...]]:
    paths: dict[str, tuple[str | int, ...]] = {}
    given = planner_data if isinstance(planner_data, dict) else {}
    for key in keys:
        p = given.get(key, (key,))
        if (not isinstance(p, tuple) or not p
                or not all(isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool) and x >= 0) for x in p)):
            raise CheckpointError(f"{where}: the planner path of '{key}' is not a tuple of str keys and list indices")
        paths[key] = p
    return paths


def read_dcp_metadata(storage: Storage, path: str) -> DcpCheckpoint:
    """Read and check the ``.metadata`` of the DCP directory ``path`` (module docstring)."""
    where = storage.url(storage.join(path, METADATA_FILE))
    raw = storage.read_small(storage.join(path, METADATA_FILE), MAX_METADATA_BYTES, follow=False)
    md = safe_loads(raw, ALLOWED, where)
    if not isinstance(md, _Metadata):
        raise CheckpointError(f"{where}: holds a {type(md).__name__}, not DCP Metadata")
    sdm, sd = md.state_dict_metadata, md.storage_data
    if not isinstance(sdm, dict) or not all(isinstance(k, str) for k in sdm):
        raise CheckpointError(f"{where}: state_dict_metadata is not a dict of str keys")
    if not isinstance(sd, dict):
        raise CheckpointError(f"{where}: storage_data is not a dict (saved by a storage writer other than torch's "
                              "FileSystemWriter?)")
    storage_by: dict[tuple, Any] = {}
    for idx, info in sd.items():
        if isinstance(idx, _MetadataIndex):
            kind = "bytes" if idx.offset is None else "tensor"
            storage_by[(kind, idx.fqn, idx.offset)] = info
    tensors, values = {}, {}
    for key, entry in sdm.items():
        if isinstance(entry, _TensorStorageMetadata):
            tensors[key] = _tensor(key, entry, storage_by, where)
        elif isinstance(entry, _BytesStorageMetadata):
            info = storage_by.get(("bytes", key, None))
            if info is None:
                raise CheckpointError(f"{where}: entry '{key}' has no entry in storage_data; the metadata is damaged")
            values[key] = DcpBytes(*_storage(info, f"{where}: entry '{key}'"))
        else:
            raise CheckpointError(f"{where}: entry '{key}' is a {type(entry).__name__}, neither a tensor nor bytes")
    version = md.version if isinstance(md.version, str) else None
    return DcpCheckpoint(tensors, values, _paths(md.planner_data, list(sdm), where), version)
