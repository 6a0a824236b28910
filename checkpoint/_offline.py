"""Offline tools (one process, no torch.distributed): merge to Hugging Face files, reshard.

Both read a checkpoint's saved boxes through safetensors slices and write new safetensors
files with ``_safetensors_io.StreamingWriter`` (which checksums every box and its checksum
chunks as a save does), one *slab* at a time: a slab is a run of
dim-0 rows of one output box of at most ``chunk_bytes`` (one row when a row is larger), read
from every saved box it meets and appended to the output file. Memory is one slab, whatever
the model size. Outputs are written into a temporary directory and renamed into place as in
[Note: atomic commit] (``_commit.py``); a failed run deletes it.

Both first verify the whole source (``verify_checkpoint``: sizes, headers, tiling, every
checksum; a box without a checksum is refused), so damage is never copied into a new file
under fresh checksums, and both refuse an ``out`` that is the source, lies inside it or holds
it, or already exists (unless ``replace=True``, and then only an earlier output of the same
kind, whose user-added files are kept).

* `merge_checkpoint` writes full tensors in safetensors files of at most ``max_shard_bytes``
  each (a larger tensor gets a file of its own). ``prefix`` selects the tensors whose flat
  key starts with it and strips it from their names (default ``"model/"``: a model's own
  names, never optimizer state). With a ``config`` the folder is a complete, checked
  ``save_pretrained`` folder (``_hf_folder.py``); without, the files are named
  ``tensors-0000i-of-0000n.safetensors`` + ``tensors.safetensors.index.json``, which
  ``load_safetensors`` reads and ``from_pretrained`` does not mistake for a model.
* `reshard_checkpoint` writes a checkpoint laid out for ``world_size`` ranks: every tensor
  saved from a DTensor becomes dim-0 shards as ``Shard(0)`` over ``world_size`` ranks would
  hold them (FSDP's layout; HSDP's too, since replicas are saved once), plain and 0-d tensors
  go to rank 0. Loading it into that layout reads one file per rank.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable

import torch
from torch.distributed.tensor import Shard

from ._checksums import BoxChecksums
from ._commit import commit, is_checkpoint, own_files, remove_temp, temp_dir_for
from ._errors import CheckpointError
from ._files import CheckpointFiles, open_checkpoint
from ._format import (FORMAT_NAME, INDEX_FILE, Index, SavedBox, StreamingWriter, TensorEntry, data_file_name,
                      format_index, index_to_json, plain_file_name)
from ._geometry import Box, LocalBox, boxes_for, distinct_boxes, plan_reads
from ._hf import HF_INDEX_FILE, TENSORS_INDEX_FILE
from ._hf_moe import Part, expert_view
from ._hf_folder import (group_shards, index_file_name, model_prefix, read_config, shard_names,
                         write_index)
from ._json_strict import parse_json_strict
from ._reads import read_region
from ._storage import PosixStorage, Storage
from ._verify import verify_checkpoint

__all__ = ["merge_checkpoint", "reshard_checkpoint"]


class _Progress:
    """A one-line progress bar on stderr (bytes done of a total), at most 10 updates a second."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.done, self.enabled, self._last = label, max(total, 1), 0, enabled, 0.0

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(30 * frac)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {100 * frac:5.1f}% {self.done / 1e6:.1f}/"
                             f"{self.total / 1e6:.1f} MB")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


class _Source:
    """Reads regions of a checkpoint's tensors from its files (opened once each, by ``files``)."""

    def __init__(self, files: CheckpointFiles) -> None:
        self.files, self.index = files, files.index

    def read(self, key: str, box: Box) -> torch.Tensor:
        entry = self.index.tensors[key]
        saved = [entry.boxes[i] for i in distinct_boxes([b.box for b in entry.boxes])]
        items = plan_reads(LocalBox(box, (0,) * len(box.sizes)), [b.box for b in saved])
        if sum(it.src.numel for it in items) != box.numel:
            raise CheckpointError(f"checkpoint {self.files.where} lacks part of tensor '{key}' (box at "
                                  f"{list(box.offsets)} of size {list(box.sizes)}); run verify")
        out = torch.empty(box.sizes, dtype=entry.dtype)
        for it in items:
            read_region(self.files, saved[it.source], it.src, out[it.dst.slices()])
        return out


def _slabs(box: Box, itemsize: int, chunk_bytes: int) -> list[Box]:
    if not box.sizes or box.numel == 0:
        return [box] if box.numel else []
    row = box.numel // box.sizes[0] * itemsize
    step = max(1, chunk_bytes // max(row, 1))
    return [Box((box.offsets[0] + s, *box.offsets[1:]), (min(step, box.sizes[0] - s), *box.sizes[1:]))
            for s in range(0, box.sizes[0], step)]


def _write(path: str, source: _Source, parts: list[tuple], chunk_bytes: int, progress: _Progress,
           metadata: dict[str, str]) -> dict[str, BoxChecksums]:
    """Write ``parts`` ``[(file_key, tensor key, global box[, shape])]`` into one safetensors
    file (``shape``: the written tensor's, default the box's sizes; an expert's ``[1, h, d]``
    box is written ``[h, d]``)."""
    by_key = {part[0]: (part[1], part[2], part[3] if len(part) > 3 else part[2].sizes) for part in parts}
    writer = StreamingWriter(path, [(fk, source.index.tensors[k].dtype, shape) for fk, (k, _, shape) in by_key.items()],
                             metadata)
    try:
        for fk in writer.keys:
            key, box, _ = by_key[fk]
            itemsize = torch.empty((), dtype=source.index.tensors[key].dtype).element_size()
            for slab in _slabs(box, itemsize, chunk_bytes):
                writer.append(source.read(key, slab))
                progress.add(slab.numel * itemsize)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def _verified(path: str | os.PathLike) -> CheckpointFiles:
    """The index of the checkpoint at ``path`` after `verify_checkpoint` found it sound and fully
    checked (every box's checksum read and matched, every tensor tiled exactly): damage is
    never passed on into a new file with fresh checksums. An index without its own checksum
    (an older shardwise) is accepted; a box without a checksum is not."""
    path = os.path.abspath(os.fspath(path))
    report = verify_checkpoint(path)
    if report.problems:
        more = f" (and {len(report.problems) - 1} more problems; run verify)" if len(report.problems) > 1 else ""
        raise CheckpointError(f"{report.problems[0]}{more}; nothing was written")
    boxes = [u for u in report.unchecked if "crc32 null" in u]
    if boxes:
        raise CheckpointError(f"{boxes[0]}; refusing to copy data that cannot be checked, nothing was written")
    return open_checkpoint(path)


def _refuse_target(source: str, out: str, replace: bool, replaceable: Callable[[Storage, str], bool],
                   what: str) -> None:
    src, dst = os.path.realpath(source), os.path.realpath(out)
    if src == dst or dst.startswith(src + os.sep) or src.startswith(dst + os.sep):
        raise CheckpointError(f"{out} is the source checkpoint {source}, inside it or contains it; write to another "
                              "path (it is never replaced)")
    if not os.path.lexists(out) or (os.path.isdir(out) and not os.path.islink(out) and not os.listdir(out)):
        return
    if not replace:
        raise CheckpointError(f"{out} already exists; refusing to write over it. Choose a new path, or pass "
                              "replace=True (--replace) to replace an existing " + what)
    if os.path.islink(out) or not replaceable(PosixStorage(), out):
        raise CheckpointError(f"{out} exists and is not {what}; refusing to replace it even with --replace")


def _into_place(source: str, out: str, fill: Callable[[str], None], replace: bool,
                replaceable: Callable[[Storage, str], bool] = is_checkpoint,
                own: Callable[[Storage, str], set[str]] = own_files, what: str = "shardwise checkpoint") -> None:
    out = os.path.abspath(os.fspath(out))
    _refuse_target(source, out, replace, replaceable, what)
    token = secrets.token_hex(4)
    storage = PosixStorage()
    tmp = temp_dir_for(storage, out, token)
    os.makedirs(tmp)
    try:
        fill(tmp)
        commit(storage, tmp, out, token, replaceable=replaceable, own=own)
    except BaseException:
        remove_temp(storage, tmp)  # a failed merge or reshard leaves nothing behind
        raise


_MERGE_MARKS = (HF_INDEX_FILE, TENSORS_INDEX_FILE, "model.safetensors")  # one of them is in every merge output


def _is_hf_export(storage: Storage, path: str) -> bool:
    return any(storage.kind(storage.join(path, m)) == "file" for m in _MERGE_MARKS)


def _hf_own_files(storage: Storage, path: str) -> set[str]:
    """What a merge wrote into ``path``: its index file and the files of its weight map."""
    names = set(_MERGE_MARKS) | {HF_INDEX_FILE + ".tmp", TENSORS_INDEX_FILE + ".tmp"}
    for index_file in (HF_INDEX_FILE, TENSORS_INDEX_FILE):
        try:
            data = storage.read_small(storage.join(path, index_file), 64 << 20)
            weight_map = parse_json_strict(data.decode("utf-8")).get("weight_map", {})
            names |= {n for n in weight_map.values() if plain_file_name(n)}
        except (OSError, ValueError, AttributeError, RecursionError, CheckpointError):
            pass
    return names


def merge_checkpoint(path: str | os.PathLike, out: str | os.PathLike, *, prefix: str | None = None,
                     config=None, max_shard_bytes: int = 5 << 30, chunk_bytes: int = 64 << 20,
                     progress: bool = False, replace: bool = False) -> list[str]:
    """Write the full tensors of the checkpoint at ``path`` into the new folder ``out`` (see the
    module docstring); returns the file names written. ``prefix`` None: the ``model/`` tensors
    (`_hf_folder.model_prefix`). With ``config`` (see `_hf_folder.read_config`) ``out`` is a
    checked, complete ``save_pretrained`` folder; without, bare ``tensors-*`` files.

    The source is verified completely first (`verify_checkpoint`); any problem raises
    `CheckpointError` and nothing is written. ``out`` must not exist (or be an empty folder)
    unless ``replace=True``, which replaces an earlier merge output (files a user added to it
    are kept); the source itself is never a valid ``out``."""
    with _verified(path) as files:
        return _merge(files, out, prefix, config, max_shard_bytes, chunk_bytes, progress, replace)


def _merge(files: CheckpointFiles, out: str | os.PathLike, prefix: str | None, config: object, max_shard_bytes: int,
           chunk_bytes: int, progress: bool, replace: bool) -> list[str]:
    index = files.index
    prefix = model_prefix(index.tensors, prefix)
    keys = [k for k in index.tensors if k.startswith(prefix)]
    if not keys:
        raise CheckpointError(f"checkpoint {files.where} has no tensor whose key starts with {prefix!r}")
    hf = read_config(config) if config is not None else None
    shapes = {k[len(prefix):]: tuple(index.tensors[k].shape) for k in keys}
    if hf is not None:  # HF's names, experts one by one ([Note: expert names in a Hugging Face folder])
        source = _Source(files)
        view = expert_view(hf.architecture, shapes)
        full = {k: Box((0,) * len(index.tensors[k].shape), index.tensors[k].shape) for k in keys}

        def same(a: str, b: str) -> bool:
            a, b = prefix + view.source.get(a, a), prefix + view.source.get(b, b)
            return torch.equal(source.read(a, full[a]), source.read(b, full[b]))

        parts = [p for n in hf.select(view.shapes, same) for p in view.parts[n]]
    else:
        parts = [Part(n, n, Box((0,) * len(s), s), s) for n, s in shapes.items()]
    nbytes = {p.name: p.box.numel * torch.empty((), dtype=index.tensors[prefix + p.source].dtype).element_size()
              for p in parts}
    by_name = {p.name: p for p in parts}
    shards = group_shards(nbytes, max_shard_bytes)
    names = shard_names(len(shards), hf is not None)
    bar = _Progress("merge", sum(nbytes.values()), progress)

    def fill(tmp: str) -> None:
        source = _Source(files)
        weight_map = {}
        for name, group in zip(names, shards):
            entries = [(n, prefix + by_name[n].source, by_name[n].box, by_name[n].shape) for n in group]
            _write(os.path.join(tmp, name), source, entries, chunk_bytes, bar, {"format": "pt"})
            weight_map.update({n: name for n in group})
        write_index(tmp, index_file_name(len(names), hf is not None), weight_map, sum(nbytes.values()))
        if hf is not None:
            hf.write(tmp)

    _into_place(files.where, os.fspath(out), fill, replace, _is_hf_export, _hf_own_files, "a merge output (a folder with "
                f"{HF_INDEX_FILE}, {TENSORS_INDEX_FILE} or model.safetensors)")
    return names


def reshard_checkpoint(path: str | os.PathLike, out: str | os.PathLike, world_size: int, *,
                       chunk_bytes: int = 64 << 20, progress: bool = False, replace: bool = False) -> None:
    """Rewrite the checkpoint at ``path`` into a new checkpoint ``out`` laid out for
    ``world_size`` ranks (see the module docstring). Plain values are kept. Verification of
    the source and the rules for ``out`` and ``replace`` are those of `merge_checkpoint`
    (``replace=True`` replaces an existing shardwise checkpoint)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    with _verified(path) as files:
        _reshard(files, out, world_size, chunk_bytes, progress, replace)


def _reshard(files: CheckpointFiles, out: str | os.PathLike, world_size: int, chunk_bytes: int, progress: bool,
             replace: bool) -> None:
    index = files.index
    per_rank: list[list[tuple[str, str, Box]]] = [[] for _ in range(world_size)]
    layouts = {}
    for key, t in index.tensors.items():
        sharded = t.layout is not None and len(t.shape) > 0
        layouts[key] = {"mesh_shape": [world_size], "mesh_dim_names": None,
                        "placements": [repr(Shard(0))]} if sharded else None
        for r in range(world_size) if sharded else [0]:
            lbs = boxes_for(t.shape, (world_size,), (r,), [Shard(0)]) if sharded else (
                [LocalBox(Box((0,) * len(t.shape), t.shape), ())] if 0 not in t.shape else [])
            per_rank[r] += [(f"{key}@{','.join(map(str, lb.box.offsets))}", key, lb.box) for lb in lbs]
    bar = _Progress("reshard", sum(t.nbytes for t in index.tensors.values()), progress)

    def fill(tmp: str) -> None:
        source = _Source(files)
        boxes: dict[str, list[SavedBox]] = {k: [] for k in index.tensors}
        sizes: dict[str, int | None] = {}
        for r, parts in enumerate(per_rank):
            if not parts:
                continue
            name = data_file_name(r)
            sums = _write(os.path.join(tmp, name), source, parts, chunk_bytes, bar,
                          {"format": FORMAT_NAME, "rank": str(r)})
            sizes[name] = os.path.getsize(os.path.join(tmp, name))
            for fk, key, box in parts:
                s = sums[fk]
                boxes[key].append(SavedBox(box, name, fk, s.crc32, s.chunk_rows, s.chunk_crc32))
        tensors = {k: TensorEntry(t.dtype, t.shape, tuple(boxes[k]), layouts[k]) for k, t in index.tensors.items()}
        new = Index(tensors, index.values, sizes, world_size, time.time_ns(),
                    save_id=os.path.basename(tmp).rsplit("-", 1)[-1])
        PosixStorage().write_atomic(os.path.join(tmp, INDEX_FILE), format_index(index_to_json(new)).encode())

    _into_place(files.where, os.fspath(out), fill, replace)
