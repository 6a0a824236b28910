"""The checkpoint index: what ``index.json`` holds, how it is read, checked and written.

The format is specified in ``docs/checkpoint-format.md``; this module is its code (the records,
`Index`, `TensorEntry`, `SavedBox`, and the format's names are in ``_index_model.py`` and
re-exported here). An `Index` maps every tensor's flat key (``_flatten.py``) to a `TensorEntry`
(dtype, global shape, layout, saved boxes with file, key, CRC-32 and chunks: [Note: checksum
chunks] in ``checkpoint/_base/_checksums.py``), every plain value's flat key to its JSON value,
and each data file to its size, so a truncated or missing file is found before any data is read.

`read_index` refuses, with a `CheckpointError` saying what the directory is and what to do,
anything that is not a complete checkpoint of a version this code reads, and any damaged or
hostile index (checksum ``index_sha256`` mismatch, a repeated JSON key, a wrongly typed field, a
data file name that is not a plain name inside the directory, a symlinked ``index.json``, a box
larger than its file). No message echoes file content beyond short excerpts of index fields.

[Note: index parts]
An index holding every box grows with world x tensors, as does what rank 0 receives (at 256
ranks and 1,000 tensors 36 MiB of JSON; at 4,096 ranks beyond `MAX_INDEX_BYTES`). From
``INDEX_PARTS_FROM`` ranks on (``_save_plan.py``) a save writes format version 2: each writing
rank puts its boxes' records into its *index part* ``rank-<rank>.boxes.json`` and reports to
rank 0 only the part's size and SHA-256; ``index.json`` lists the parts under ``parts`` and keeps
every tensor's dtype, shape and layout with ``boxes`` empty. Its checksum covers the parts'
SHA-256s, so a damaged, missing or swapped part is refused like a damaged index. `read_index`
merges the parts into the same `Index` as version 1, so readers do not know the difference.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from typing import Any

import torch

from .._geometry import Box
from .._base import CheckpointError, DuplicateKey, IndexMissing, box_rows, chunk_count, crcs_from_hex, crcs_to_hex, parse_json_strict
from ._file_io import pread_exact
from .._storage import DirView, Storage, storage_for
from ._index_model import (CHECKSUM_FIELD, DCP_MARKER, FORMAT_NAME, FORMAT_VERSION, INCOMPLETE_MARK, INDEX_FILE,
                           PART_SUFFIX, PARTS_VERSION, POINTER_VERSION, READ_VERSIONS, VERSION_MARK, Index, SavedBox,
                           TensorEntry, data_file_name, dcp_marker, dtype_from_name, dtype_name, part_file_name,
                           plain_file_name, pointer_at, pointer_bytes)

__all__ = [
    "DCP_MARKER", "dcp_marker", "FORMAT_NAME", "FORMAT_VERSION", "INDEX_FILE", "Index", "SavedBox", "TensorEntry",
    "dtype_name", "dtype_from_name", "read_index", "index_to_json", "format_index", "data_file_name",
    "describe_non_checkpoint", "MAX_INDEX_BYTES", "PART_SUFFIX", "PARTS_VERSION", "own_names", "part_file_name", "part_to_json",
    "POINTER_VERSION", "VERSION_MARK", "Pointer", "pointer_at", "pointer_bytes",
]


class Pointer(CheckpointError):
    """`read_index` found a pointer ([Note: commit by a pointer] in ``checkpoint/_series/_commit.py``):
    the index is in the folder ``at`` inside the directory; ``raw`` is the pointer's bytes."""

    def __init__(self, at: str, raw: bytes) -> None:
        super().__init__(f"index.json names the folder {at} holding the index")
        self.at, self.raw = at, raw

def _box_to_json(b: SavedBox) -> dict:
    out: dict[str, Any] = {"offsets": list(b.box.offsets), "sizes": list(b.box.sizes), "file": b.file, "key": b.key,
           "crc32": None if b.crc32 is None else f"{b.crc32:08x}"}
    if b.chunk_crc32 is not None:
        out["chunk_rows"] = b.chunk_rows
        out["chunk_crc32"] = crcs_to_hex(b.chunk_crc32)
    return out


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _ints(v, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ValueError(f"{what} must be a list of non-negative integers, got {_short(v)}")
    return tuple(v)


def _file_of(b: dict, tensor: str) -> str:
    name = b.get("file")
    if not plain_file_name(name):
        raise CheckpointError(f"tensor '{tensor}': data file name {_short(name)} is not a plain file name inside the "
                              "checkpoint directory (absolute, '..', a sub-directory or hidden); refusing to read it")
    assert isinstance(name, str)
    return name


def _box_from_json(b: dict, tensor: str, file: str) -> SavedBox:
    if not isinstance(b, dict):
        raise ValueError(f"tensor '{tensor}': a box must be an object, got {_short(b)}")
    box = Box(_ints(b["offsets"], f"tensor '{tensor}': 'offsets'"), _ints(b["sizes"], f"tensor '{tensor}': 'sizes'"))
    name, key, crc = _file_of(b, tensor), b["key"], b.get("crc32")
    if not isinstance(key, str):
        raise ValueError(f"tensor '{tensor}': box 'key' must be a string, got {_short(key)}")
    if crc is not None and not (isinstance(crc, str) and len(crc) == 8 and all(c in "0123456789abcdef" for c in crc)):
        raise ValueError(f"tensor '{tensor}': box 'crc32' must be 8 lowercase hex digits or null, got {_short(crc)}")
    crc = None if crc is None else int(crc, 16)
    rows, chunks = b.get("chunk_rows"), b.get("chunk_crc32")
    if rows is None and chunks is None:
        return SavedBox(box, name, key, crc)
    where = f"{file} is damaged: tensor '{tensor}' box at {list(box.offsets)} (key '{key}')"
    if rows is None or chunks is None:
        raise CheckpointError(f"{where} has only one of 'chunk_rows' and 'chunk_crc32'; both or neither are needed")
    total = box_rows(box.sizes)[0]
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise CheckpointError(f"{where}: 'chunk_rows' must be an integer >= 1, got {_short(rows)}")
    try:
        crcs = crcs_from_hex(chunks, chunk_count(total, rows))
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e} (a box of {total} rows in chunks of {rows} rows)") from None
    return SavedBox(box, name, key, crc, rows, crcs)


def index_to_json(index: Index) -> dict:
    tensors = {}
    for key, t in index.tensors.items():
        tensors[key] = {
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "layout": t.layout,
            "boxes": [_box_to_json(b) for b in t.boxes],
        }
    obj = {
        "format": FORMAT_NAME,
        "version": PARTS_VERSION if index.parts else FORMAT_VERSION,
        "created_unix_ns": index.created_unix_ns,
        "world_size": index.world_size,
        "files": {name: {"bytes": size} for name, size in sorted(index.files.items())},
        "tensors": tensors,
        "values": index.values,
        **({"save_id": index.save_id} if index.save_id is not None else {}),
        **({"bytes": sorted(index.blobs)} if index.blobs else {}),
        **({"parts": {name: {"bytes": n, "sha256": sha} for name, (n, sha) in sorted(index.parts.items())}}
           if index.parts else {}),
    }
    obj[CHECKSUM_FIELD] = index_checksum(obj)
    return obj


def part_to_json(boxes: dict[str, list[SavedBox]]) -> bytes:
    """The bytes of an index part holding ``boxes`` (tensor key -> its boxes in the part;
    [Note: index parts])."""
    body = {"format": FORMAT_NAME, "part": True, "tensors": {k: [_box_to_json(b) for b in bs] for k, bs in boxes.items()}}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def own_names(raw: dict | None) -> set[str]:
    """The names in a checkpoint directory that the format wrote, from its parsed index ``raw``
    (None: no index): the index (and its temporary name), the ``.metadata`` marker, the data files
    and the index parts it lists."""
    names = {INDEX_FILE, INDEX_FILE + ".tmp", DCP_MARKER}
    for field in ("files", "parts"):
        listed = raw.get(field) if raw else None
        if isinstance(listed, dict):
            names |= {n for n in listed if plain_file_name(n)}
    return names


def index_checksum(obj: dict) -> str:
    """SHA-256 of the index without its own checksum field, as canonical JSON (sorted keys, no
    spaces, ASCII): it covers every field, plain values included. See checkpoint-format.md."""
    body = {k: v for k, v in obj.items() if k != CHECKSUM_FIELD}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def format_index(obj: dict) -> str:
    """The index as text: one line per top-level field, per file and per tensor."""

    def compact(v: Any) -> str:
        return json.dumps(v, separators=(", ", ": "))

    lines = []
    for k, v in obj.items():
        if isinstance(v, dict) and v and k in ("files", "tensors", "values"):
            inner = [f"  {json.dumps(name)}: {compact(item)}" for name, item in v.items()]
            lines.append(f"{json.dumps(k)}: {{\n" + ",\n".join(inner) + "\n }")
        else:
            lines.append(f"{json.dumps(k)}: {compact(v)}")
    return "{\n " + ",\n ".join(lines) + "\n}\n"


def describe_non_checkpoint(storage: Storage, path: str) -> str:
    """Why the directory ``path`` of ``storage`` is not a checkpoint, as one sentence for the user."""
    where = storage.url(path)
    try:
        kind = storage.kind(path)
        names = storage.list(path) if kind == "dir" else []
    except PermissionError:
        return f"{where}: permission denied (it may exist; this user cannot read it)"
    except OSError:
        return f"{where} does not exist"
    if kind == "missing":
        return f"{where} does not exist"
    if kind != "dir":
        return f"{where} is a file, not a checkpoint directory"
    if INCOMPLETE_MARK in storage.name(path):
        return (f"{where} is an incomplete save (the saving job stopped before committing it; see the "
                "checkpoint with the same name without '.incomplete-...'); load the previous checkpoint instead")
    if any(n.endswith(".safetensors") for n in names):
        return (f"{where} has safetensors files but no {INDEX_FILE}, so it is not a shardwise checkpoint (an "
                "incomplete save or a Hugging Face folder? for the latter use load_safetensors)")
    return f"{where} is not a shardwise checkpoint: it has no {INDEX_FILE} (contents: {names[:8]})"


MAX_INDEX_BYTES = 256 << 20  # 1M boxes with chunk checksums take about 300 bytes each


def _read_index_bytes(view: DirView, file: str) -> bytes:
    """The bytes of the index, bounded before reading: at most `MAX_INDEX_BYTES`, and a file that
    does not start like a JSON object (say, 900 MB of NULs) is refused after reading 64 bytes."""
    h = view.open_read(INDEX_FILE, follow=False)
    try:
        if h.size > MAX_INDEX_BYTES:
            raise CheckpointError(f"{file} has {h.size} bytes, more than an index can have ({MAX_INDEX_BYTES}); the "
                                  "index is damaged")
        head = pread_exact(h, 64, 0).lstrip(b" \t\r\n")
        if not head.startswith(b"{"):
            raise CheckpointError(f"{file} is not valid UTF-8 JSON; the index is damaged")
    finally:
        h.close()
    return view.read_small(INDEX_FILE, MAX_INDEX_BYTES, follow=False)


def _typed(raw: dict, field: str, kind: type, file: str, default: Any = None) -> Any:
    v = raw.get(field, default)
    if not isinstance(v, kind):
        raise CheckpointError(f"{file} is damaged: '{field}' must be a JSON {'object' if kind is dict else kind.__name__}, "
                              f"got {type(v).__name__}")
    return v


def read_index(view: DirView | str | os.PathLike, storage: Storage | None = None) -> Index:
    """Read and check ``index.json`` of the directory ``view`` (of ``storage``; a path or URL is
    opened first, ``_storage.storage_for``): a regular file (not
    a symlink, never opened when it is a FIFO or a device) of valid JSON without duplicate keys,
    of this format and version, with every field of the right type; data file names plain names
    inside the directory, every box's file listed in ``files`` and no larger than it; and its own
    checksum, when it has one, matching (``Index.checksummed``)."""
    if isinstance(view, (str, os.PathLike)):
        storage, norm = storage_for(view, storage)
        pinned = storage.open_dir(norm)
        try:
            return read_index(pinned, storage)
        finally:
            pinned.close()
    assert storage is not None, "read_index(view, storage): the storage of the view"
    path = view.path
    file = posixpath.join(storage.url(path), INDEX_FILE)
    if INCOMPLETE_MARK in storage.name(path):
        raise CheckpointError(describe_non_checkpoint(storage, path))
    text = None
    if not view.pinned:  # fsspec: read_small checks the kind itself (one ranged GET on an object store)
        try:
            text = view.read_small(INDEX_FILE, MAX_INDEX_BYTES)
        except OSError:
            pass  # said below
        except CheckpointError:
            if view.kind(INDEX_FILE) not in ("missing", "link", "other"):
                raise
    kind = view.kind(INDEX_FILE) if text is None else "file"
    if kind == "missing":
        raise IndexMissing(describe_non_checkpoint(storage, path))
    if kind == "link":
        raise CheckpointError(f"{file} is a symbolic link; an index must be a regular file inside the checkpoint")
    if kind != "file":
        raise CheckpointError(f"{file} is not a regular file")
    try:
        text = _read_index_bytes(view, file) if text is None else text
        if not text.lstrip(b" \t\r\n").startswith(b"{"):
            raise CheckpointError(f"{file} is not valid UTF-8 JSON; the index is damaged")
    except PermissionError:
        raise CheckpointError(f"{file}: permission denied (cannot read the index)") from None
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read the index ({e.strerror or type(e).__name__})") from None
    try:
        raw = parse_json_strict(text.decode("utf-8"))
    except DuplicateKey as e:
        raise CheckpointError(f"{file} is damaged: the key {_short(str(e))} appears twice in one object") from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise CheckpointError(f"{file} is not valid UTF-8 JSON; the index is damaged") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{file} is not a {FORMAT_NAME} index (its 'format' is {_short(raw.get('format'))})"
                              if isinstance(raw, dict) else f"{file} is not a {FORMAT_NAME} index")
    at = pointer_at(raw)
    if at is not None:
        raise Pointer(at, text)
    version = raw.get("version")
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise CheckpointError(f"{file} has format version {_short(version)}; this shardwise reads versions "
                              f"{', '.join(map(str, READ_VERSIONS))}. Use the shardwise release that wrote it")
    checksummed = CHECKSUM_FIELD in raw
    if checksummed and raw[CHECKSUM_FIELD] != index_checksum(raw):
        raise CheckpointError(f"{file} is damaged: its own checksum ({CHECKSUM_FIELD}) does not match its contents; "
                              "restore it or load another checkpoint")
    try:
        raw_files = _typed(raw, "files", dict, file, {})
        files = {}
        for name, f in raw_files.items():
            if not plain_file_name(name):
                raise CheckpointError(f"{file}: data file name {_short(name)} is not a plain file name inside the "
                                      "checkpoint directory (absolute, '..', a sub-directory or hidden); refusing it")
            size = f.get("bytes") if isinstance(f, dict) else None
            if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
                raise ValueError(f"file {name}: 'bytes' must be a non-negative integer, got {_short(size)}")
            files[name] = size
        raw_tensors = _typed(raw, "tensors", dict, file)
        boxes: dict[str, list[SavedBox]] = {}
        for key, t in raw_tensors.items():
            if not isinstance(t, dict) or not isinstance(t.get("boxes"), list):
                raise ValueError(f"tensor '{key}' must be an object with a 'boxes' list")
            boxes[key] = [_box_from_json(b, key, file) for b in t["boxes"]]
        parts = _typed(raw, "parts", dict, file, {})
        if parts and version != PARTS_VERSION:
            raise CheckpointError(f"{file} is damaged: it lists index parts but has format version {version}")
        for name, rec in sorted(parts.items()):
            _read_part(view, storage, name, rec, boxes, file)
        tensors = {}
        for key, t in raw_tensors.items():
            dtype = dtype_from_name(t["dtype"]) if isinstance(t["dtype"], str) else dtype_from_name("?")
            entry = TensorEntry(dtype, _ints(t["shape"], f"tensor '{key}': 'shape'"), tuple(boxes[key]), t.get("layout"))
            _check_boxes_fit(entry, key, files, file)
            tensors[key] = entry
        values = _typed(raw, "values", dict, file, {})
        blobs = frozenset(_typed(raw, "bytes", list, file, []))
        bad = [k for k in blobs if not isinstance(k, str) or k not in tensors or tensors[k].dtype != torch.uint8
               or len(tensors[k].shape) != 1]
        if bad:
            raise CheckpointError(f"{file} is damaged: 'bytes' names {_short(bad[0])}, which is not a 1-D uint8 tensor "
                                  "of 'tensors'")
        created, world, save_id = raw.get("created_unix_ns"), raw.get("world_size"), raw.get("save_id")
        return Index(tensors, values, files, world if isinstance(world, int) else None,
                     created if isinstance(created, int) else None, version, checksummed,
                     save_id if isinstance(save_id, str) else None, blobs)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file} is damaged: {type(e).__name__}: {e}") from None


def _read_part(view: DirView, storage: Storage, name: Any, rec: Any, boxes: dict[str, list[SavedBox]],
               file: str) -> None:
    """Add the boxes of index part ``name`` (its record ``rec`` in the index) to ``boxes``;
    `CheckpointError` when the part is not the one the index names ([Note: index parts])."""
    if not plain_file_name(name):
        raise CheckpointError(f"{file}: index part name {_short(name)} is not a plain file name inside the checkpoint "
                              "directory (absolute, '..', a sub-directory or hidden); refusing it")
    size, sha = rec.get("bytes") if isinstance(rec, dict) else None, rec.get("sha256") if isinstance(rec, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_INDEX_BYTES or not (
            isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        raise ValueError(f"index part {name}: needs 'bytes' (an integer up to {MAX_INDEX_BYTES}) and 'sha256' "
                         f"(64 lowercase hex digits), got {_short(rec)}")
    where = posixpath.join(storage.url(view.path), name)
    kind = view.kind(name)
    if kind != "file":
        what = {"missing": "is missing", "link": "is a symbolic link"}.get(kind, "is not a regular file")
        raise CheckpointError(f"index part {where} {what}; the checkpoint is damaged (restore the file or load "
                              "another checkpoint)")
    try:
        data = view.read_small(name, size + 1, follow=False)
    except OSError as e:
        raise CheckpointError(f"index part {where}: cannot read it ({e.strerror or type(e).__name__})") from None
    if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
        raise CheckpointError(f"index part {where} is damaged: its {len(data)} bytes do not match the size and SHA-256 "
                              f"that {file} records; restore it or load another checkpoint")
    try:
        body = parse_json_strict(data.decode("utf-8"))
    except (DuplicateKey, ValueError, UnicodeDecodeError, RecursionError):
        raise CheckpointError(f"index part {where} is not valid UTF-8 JSON; the checkpoint is damaged") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME or not isinstance(body.get("tensors"), dict):
        raise CheckpointError(f"index part {where} is not a {FORMAT_NAME} index part; the checkpoint is damaged")
    for key, records in body["tensors"].items():
        if key not in boxes or not isinstance(records, list):
            raise CheckpointError(f"index part {where} is damaged: it has boxes of {_short(key)}, which is not a tensor "
                                  f"of {file}")
        try:
            boxes[key] += [_box_from_json(b, key, where) for b in records]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"index part {where} is damaged: {type(e).__name__}: {e}") from None


def _check_boxes_fit(entry: TensorEntry, key: str, files: dict[str, int | None], file: str) -> None:
    """Every box of ``entry`` sits in a listed file, within the tensor's rank, and its bytes fit in
    that file's recorded size (so a damaged size is refused before anything is allocated)."""
    itemsize = torch.empty((), dtype=entry.dtype).element_size()
    for b in entry.boxes:
        if b.file not in files:
            raise CheckpointError(f"{file} is damaged: tensor '{key}' has a box in {b.file}, which 'files' does not list")
        if len(b.box.sizes) != len(entry.shape):
            raise CheckpointError(f"{file} is damaged: tensor '{key}' has {len(entry.shape)} dimensions but a box "
                                  f"with {len(b.box.sizes)}")
        size = files[b.file]
        if size is not None and b.box.numel * itemsize > size:
            raise CheckpointError(f"{file} is damaged: tensor '{key}' has a box of {b.box.numel * itemsize} bytes in "
                                  f"{b.file}, which has only {size} bytes")
