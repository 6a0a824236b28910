"""The ``torch.save`` records inside a ``.distcp`` file, read without ``torch.load``.

DCP writes each entry of a rank as one ``torch.save`` archive, back to back; the metadata gives
each one's byte range. An archive is an uncompressed ZIP: ``<name>/data.pkl`` (protocol 2),
``<name>/byteorder``, ``<name>/data/<key>`` (raw little-endian storage bytes). A tensor chunk's
pickle is ``torch._utils._rebuild_tensor_v2(<storage pid>, offset, size, stride, False,
OrderedDict())`` (``_v3(..., dtype)`` with an ``UntypedStorage`` for float8 / uint16-64), the pid
``("storage", torch.FloatStorage, "0", "cpu", numel)``; a non-tensor entry is the value itself.
`tensor_record` reads it with `_unpickle.safe_loads` into a `TensorRecord` saying where the bytes
are; `value_record` admits only plain values. Each member's ZIP CRC-32 is kept (``0``: none
written) to check the copy against.
"""

from __future__ import annotations

import io
import math
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from .._base import CheckpointError
from .._format import pread_exact
from .._storage import ReadHandle
from ._metadata import DTYPES
from ._unpickle import Call, safe_loads

__all__ = ["Member", "TensorRecord", "members", "tensor_record", "value_record"]

MAX_PICKLE_BYTES = 256 << 20


class _Window(io.RawIOBase):
    """Bytes ``[base, base + length)`` of an open file as a seekable binary stream (for ``zipfile``)."""

    def __init__(self, h: ReadHandle, base: int, length: int) -> None:
        super().__init__()
        self._h, self._base, self._len, self._pos = h, base, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = max(0, [offset, self._pos + offset, self._len + offset][whence])
        return self._pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = min(len(view), max(0, self._len - self._pos))
        if n == 0:
            return 0
        got = self._h.readinto([view[:n]], self._base + self._pos)
        self._pos += got
        return got


@dataclass(frozen=True)
class Member:
    start: int  # absolute byte offset of the member's data in the file
    size: int
    crc32: int | None  # None: not recorded


def members(h: ReadHandle, offset: int, length: int, where: str) -> tuple[str, dict[str, Member]]:
    """``(prefix, {name without prefix: Member})`` of the torch.save archive at ``[offset,
    offset + length)`` of ``h``; every member stored uncompressed inside that range."""
    if pread_exact(h, 4, offset) != b"PK\x03\x04":
        raise CheckpointError(f"{where}: not a torch.save record (saved with serialization_format=SAFETENSORS or "
                              "by another storage writer? import-dcp reads DCP's default torch.save format)")
    try:
        infos = zipfile.ZipFile(_Window(h, offset, length)).infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, OSError, struct.error) as e:
        raise CheckpointError(f"{where}: damaged torch.save record ({str(e)[:80]})") from None
    pkl = [i.filename for i in infos if i.filename.endswith("data.pkl") and i.filename.count("/") == 1]
    if len(pkl) != 1:
        raise CheckpointError(f"{where}: a torch.save record without exactly one data.pkl")
    prefix = pkl[0][: -len("data.pkl")]
    out = {}
    for i in infos:
        if not i.filename.startswith(prefix):
            continue
        if i.compress_type != zipfile.ZIP_STORED or i.compress_size != i.file_size:
            raise CheckpointError(f"{where}: member {i.filename[:60]!r} is compressed; torch.save never does that")
        head = pread_exact(h, 30, offset + i.header_offset)
        if len(head) < 30 or head[:4] != b"PK\x03\x04":
            raise CheckpointError(f"{where}: damaged torch.save record (member {i.filename[:60]!r} has no local header)")
        n, m = struct.unpack("<HH", head[26:30])
        start = i.header_offset + 30 + n + m
        if start + i.file_size > length:
            raise CheckpointError(f"{where}: member {i.filename[:60]!r} runs past the end of the record (truncated?)")
        out[i.filename[len(prefix):]] = Member(offset + start, i.file_size, i.CRC or None)
    return prefix, out


def _read_member(h: ReadHandle, m: Member, where: str, limit: int = MAX_PICKLE_BYTES) -> bytes:
    if m.size > limit:
        raise CheckpointError(f"{where}: a {m.size}-byte pickle, more than the {limit} bytes import-dcp reads")
    data = pread_exact(h, m.size, m.start)
    if len(data) != m.size:
        raise CheckpointError(f"{where}: truncated: the file ends inside the record")
    if m.crc32 is not None and zlib.crc32(data) != m.crc32:
        raise CheckpointError(f"{where}: checksum mismatch in the record's pickle (the file is corrupted)")
    return data


@dataclass(frozen=True)
class TensorRecord:
    """Where one saved tensor's bytes are: element ``i`` of the tensor (row-major index
    ``idx``) is element ``storage_offset + sum(idx[d] * stride[d])`` of the storage, whose
    bytes are ``data``."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    data: Member


class _StorageType:
    """``torch.<X>Storage`` (typed: elements of ``dtype``) or ``UntypedStorage`` (bytes)."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype

    def __setstate__(self, state: Any) -> None:
        raise CheckpointError("the pickle tries to change a storage type; refusing it")


_STORAGES = {"Float": torch.float32, "Double": torch.float64, "Half": torch.float16, "BFloat16": torch.bfloat16,
             "Long": torch.int64, "Int": torch.int32, "Short": torch.int16, "Char": torch.int8, "Byte": torch.uint8,
             "Bool": torch.bool, "ComplexFloat": torch.complex64, "ComplexDouble": torch.complex128}


@dataclass(frozen=True)
class _StorageRef:
    dtype: torch.dtype | None
    key: str
    numel: int  # elements of ``dtype``; bytes when untyped


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, tuple) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise CheckpointError(f"the record's {what} is not a tuple of non-negative integers")
    return v


def _hooks(*args: Any) -> dict:
    if args:
        raise CheckpointError("an OrderedDict built with arguments in a tensor record")
    return {}


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
             dtype: Any = None, metadata: Any = None) -> tuple[_StorageRef, torch.dtype, tuple, tuple, int]:
    if not isinstance(storage, _StorageRef) or hooks != {} or metadata not in (None, {}):
        raise CheckpointError("a tensor record with backward hooks, metadata or no storage")
    dt = storage.dtype if dtype is None else dtype
    if not isinstance(dt, torch.dtype) or (storage.dtype is not None and dtype is not None):
        raise CheckpointError("a tensor record without a dtype")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise CheckpointError("a tensor record with a bad storage offset")
    return storage, dt, _ints(size, "size"), _ints(stride, "stride"), offset


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any,
                metadata: Any = None) -> tuple:
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError("a tensor record (v3) without a dtype")
    return _rebuild(storage, offset, size, stride, requires_grad, hooks, dtype, metadata)


def _persistent(pid: Any) -> _StorageRef:
    if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage" or not isinstance(pid[1], _StorageType)
            or not isinstance(pid[2], str) or not isinstance(pid[4], int) or pid[4] < 0):
        raise CheckpointError("a tensor record refers to something other than a storage")
    return _StorageRef(pid[1].dtype, pid[2], pid[4])


_TENSOR_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): Call(_rebuild),
    ("torch._utils", "_rebuild_tensor_v3"): Call(_rebuild_v3),
    ("collections", "OrderedDict"): Call(_hooks),
    ("torch.storage", "UntypedStorage"): _StorageType(None),
    **{("torch", f"{n}Storage"): _StorageType(d) for n, d in _STORAGES.items()},
    **{("torch", n): d for n, d in DTYPES.items()},
}


def _past_end(size: tuple, stride: tuple, offset: int, numel: int) -> bool:
    """Whether a non-empty strided view reaches past ``numel`` elements of its storage."""
    return math.prod(size) > 0 and offset + sum((n - 1) * st for n, st in zip(size, stride)) >= numel


def _check_byteorder(h: ReadHandle, found: dict[str, Member], where: str) -> None:
    if "byteorder" in found and _read_member(h, found["byteorder"], where, 16) != b"little":
        raise CheckpointError(f"{where}: saved on a big-endian machine, which import-dcp does not convert")


def tensor_record(h: ReadHandle, offset: int, length: int, where: str) -> TensorRecord:
    """The tensor saved at ``[offset, offset + length)`` of ``h`` (see the module docstring)."""
    prefix, found = members(h, offset, length, where)
    _check_byteorder(h, found, where)
    got = safe_loads(_read_member(h, found["data.pkl"], where), _TENSOR_ALLOWED, where, _persistent)
    if not isinstance(got, tuple) or len(got) != 5 or not isinstance(got[0], _StorageRef):
        raise CheckpointError(f"{where}: the record holds no tensor (a non-tensor entry where the metadata says "
                              "tensor?)")
    storage, dtype, size, stride, storage_offset = got
    data = found.get(f"data/{storage.key}")
    if data is None:
        raise CheckpointError(f"{where}: the record lacks the data of storage {storage.key[:20]!r}")
    itemsize = dtype.itemsize
    nbytes = storage.numel * (1 if storage.dtype is None else itemsize)
    if data.size != nbytes or nbytes % itemsize or len(stride) != len(size):
        raise CheckpointError(f"{where}: the record's storage size or strides do not match its data")
    if _past_end(size, stride, storage_offset, nbytes // itemsize):
        raise CheckpointError(f"{where}: the record's tensor reaches past the end of its storage")
    return TensorRecord(dtype, size, stride, storage_offset, data)


_VALUE_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): Call(lambda *a: dict(*a)),
    ("torch", "Size"): Call(lambda *a: tuple(*a)),
}


def _embedded_loaders(h: ReadHandle, found: dict[str, Member], where: str) -> tuple[dict, Any]:
    """The allowlist and storage loader of a value record holding tensors (DCP saves a tuple of
    tensors as one entry): each becomes a real CPU tensor read from the in-memory record."""
    storages: dict[str, torch.Tensor] = {}

    def load_storage(pid: Any) -> _StorageRef:
        ref = _persistent(pid)
        if ref.key not in storages:
            m = found.get(f"data/{ref.key}")
            if m is None:
                raise CheckpointError(f"{where}: the record lacks the data of storage {ref.key[:20]!r}")
            storages[ref.key] = torch.frombuffer(bytearray(_read_member(h, m, where, m.size)) or bytearray(1),
                                                 dtype=torch.uint8)[: m.size]
        return ref

    def rebuild(*args: Any) -> torch.Tensor:
        ref, dtype, size, stride, offset = (_rebuild_v3 if len(args) >= 7 and isinstance(args[6], torch.dtype)
                                            else _rebuild)(*args)
        data = storages[ref.key]
        if data.numel() % dtype.itemsize:
            raise CheckpointError(f"{where}: a tensor's storage is not a whole number of {dtype} elements")
        typed = data.view(dtype) if data.numel() else torch.empty(0, dtype=dtype)
        if _past_end(size, stride, offset, typed.numel()):
            raise CheckpointError(f"{where}: a tensor reaches past the end of its storage")
        return torch.as_strided(typed, size, stride, offset).clone() if math.prod(size) else torch.empty(size, dtype=dtype)

    allowed = {**_TENSOR_ALLOWED, **_VALUE_ALLOWED, ("torch._utils", "_rebuild_tensor_v2"): Call(rebuild),
               ("torch._utils", "_rebuild_tensor_v3"): Call(rebuild)}
    return allowed, load_storage


def value_record(h: ReadHandle, offset: int, length: int, where: str) -> Any:
    """The value saved at ``[offset, offset + length)`` of ``h``: None, bool, int, float, str,
    bytes, lists, tuples and dicts of them, and tensors inside them (read whole: they are
    part of this one entry)."""
    _, found = members(h, offset, length, where)
    _check_byteorder(h, found, where)
    allowed, storage = _embedded_loaders(h, found, where)
    return safe_loads(_read_member(h, found["data.pkl"], where), allowed, where, storage)
