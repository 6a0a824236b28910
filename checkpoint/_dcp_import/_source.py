"""The source of an import (step 2 of [Note: the steps of an import] in ``_convert.py``): the
directory checked to be a torch DCP checkpoint, and every data file its metadata names opened,
with every byte range the metadata places in it checked against the file's size."""

from __future__ import annotations

from .._base import CheckpointError
from .._format import INDEX_FILE
from .._storage import ReadHandle
from ._metadata import DcpCheckpoint, METADATA_FILE

__all__ = ["source_dir", "rank_of", "open_files"]


def source_dir(storage, path: str, src: str) -> list[str]:
    """The names in the DCP directory ``path`` (``src`` as the user gave it), after checking that
    it is one: a directory with the global ``.metadata``; a shardwise checkpoint, rank-local
    metadata only, or anything else is refused in one line saying what it is."""
    kind = storage.kind(path)
    if kind == "missing":
        raise CheckpointError(f"{src} does not exist")
    if kind != "dir":
        raise CheckpointError(f"{src} is not a directory; import-dcp reads a torch DCP checkpoint directory")
    names = sorted(storage.list(path))
    if METADATA_FILE in names:
        return names
    if INDEX_FILE in names:
        raise CheckpointError(f"{src} is already a shardwise checkpoint (it has {INDEX_FILE}); load it directly, "
                              "there is nothing to import")
    if any(n.startswith("__") and n.endswith(".metadata") for n in names):
        raise CheckpointError(f"{src} has only rank-local __<rank>.metadata files (saved without rank coordination) "
                              f"and no {METADATA_FILE}; import-dcp needs the global {METADATA_FILE}")
    raise CheckpointError(f"{src} is not a torch DCP checkpoint: it has no {METADATA_FILE} (contents: {names[:8]})")


def rank_of(name: str) -> int | None:
    """The saving rank in a data file's name ``__<rank>_<k>.distcp``, None for another name."""
    parts = name.split("_")  # __<rank>_<k>.distcp
    return int(parts[2]) if len(parts) >= 4 and parts[0] == parts[1] == "" and parts[2].isdigit() else None


def open_files(storage, path: str, dcp: DcpCheckpoint, src: str) -> dict[str, ReadHandle]:
    """Every file the metadata names, opened, with every byte range checked against its size."""
    ranges: dict[str, list[tuple[str, int, int]]] = {}
    for key, t in dcp.tensors.items():
        for c in t.chunks:
            ranges.setdefault(c.file, []).append((key, c.offset, c.length))
    for key, v in dcp.values.items():
        ranges.setdefault(v.file, []).append((key, v.offset, v.length))
    handles: dict[str, ReadHandle] = {}
    try:
        for name in sorted(ranges):
            where = storage.url(storage.join(path, name))
            if storage.kind(storage.join(path, name)) == "missing":
                raise CheckpointError(f"{where} is missing: the metadata places {len(ranges[name])} entries in it "
                                      f"(e.g. '{ranges[name][0][0]}'); copy the whole DCP directory")
            h = handles[name] = storage.open_read(storage.join(path, name), follow=False)
            key, begin, length = max(ranges[name], key=lambda r: r[1] + r[2])
            if begin + length > h.size:
                raise CheckpointError(f"{where} is truncated: it has {h.size} bytes, but the metadata places entry "
                                      f"'{key}' at bytes [{begin}, {begin + length})")
    except BaseException:
        for h in handles.values():
            h.close()
        raise
    return handles
