"""torch DCP's call forms for `save`, `load` and `async_save`.

``save(state_dict, checkpoint_id=path)`` is ``save(state_dict, path)``; DCP's other arguments:

* ``process_group``: ``None`` or a group of every rank. A shardwise checkpoint is always written
  and read by the whole world (each box by one rank holding it, so HSDP needs no "one replica
  group saves" group); a smaller group is refused with that explanation.
* ``no_dist=True``: this process saves or loads alone, with no collective; its tensors must be
  whole, and each rank needs its own path. Without ``torch.distributed`` that happens anyway.
* ``storage_writer=FileSystemWriter(path)`` / ``storage_reader=FileSystemReader(path)`` are the path.
* ``async_checkpointer_type``: DCP's ``AsyncCheckpointerType`` by value or name (not imported
  here), or ``"thread"`` / ``"process"`` ([Note: the writer process] in
  ``checkpoint/_save/_process_writer.py``); `async_checkpointer_kind` reads it.
* ``planner=DefaultSavePlanner()`` / ``DefaultLoadPlanner()`` are no planner;
  ``DefaultLoadPlanner(allow_partial_load=True)`` is ``strict=False``.
* other ``storage_writer`` / ``storage_reader`` / ``planner`` / ``async_stager`` /
  ``use_collectives=False``: DCP's extension points, each refused with one line naming the
  shardwise way (a path or fsspec URL, ``storage=``, the state tree).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from torch.distributed.tensor import DTensor

from .._base import alone
from ._flatten import flatten

__all__ = ["DefaultLoadPlanner", "DefaultSavePlanner", "FileSystemReader", "FileSystemWriter", "async_checkpointer_kind", "check_alone_state", "checkpoint_path",
           "dcp_scope", "refuse_dcp_extensions"]

_WAYS = {
    "storage_writer": "pass shardwise.checkpoint.FileSystemWriter(path), the checkpoint's path or fsspec URL "
                      "(checkpoint_id= or the second argument), or storage= with a shardwise Storage",
    "storage_reader": "pass shardwise.checkpoint.FileSystemReader(path), the checkpoint's path or fsspec URL "
                      "(checkpoint_id= or the second argument), or storage= with a shardwise Storage",
    "planner": "shardwise plans from the state itself: put in the state exactly the tensors and values to save "
               "or load (strict=False on load skips keys the checkpoint lacks)",
    "async_stager": "async_save always copies the state to CPU memory before it returns",
    "use_collectives": "shardwise coordinates every save over the ranks; leave use_collectives at True",
}

_ASYNC_KINDS = ("thread", "process")


def async_checkpointer_kind(value: Any) -> str:
    """``"thread"`` or ``"process"`` for ``async_save``'s ``async_checkpointer_type``: ``None``
    (thread), torch DCP's ``AsyncCheckpointerType`` member (by its ``value`` or ``name``, so
    torch's enum need not be imported), or the string, in any case. Anything else is a
    ``ValueError`` naming the choices."""
    if value is None:
        return "thread"
    for candidate in (getattr(value, "value", None), getattr(value, "name", None), value):
        if isinstance(candidate, str) and candidate.lower() in _ASYNC_KINDS:
            return candidate.lower()
    raise ValueError(f"shardwise.checkpoint.async_save(): async_checkpointer_type must be 'thread' or 'process' "
                     f"(or torch's AsyncCheckpointerType.THREAD / .PROCESS), got {value!r}")


def refuse_dcp_extensions(call: str, **given: Any) -> None:
    """Raise ``TypeError`` naming the first DCP-only argument that was given a value."""
    for name, value in given.items():
        if name == "use_collectives" and value is True:
            continue
        if value is None or (name == "planner" and type(value) is (DefaultLoadPlanner if call == "load"
                                                                   else DefaultSavePlanner)):
            continue
        raise TypeError(f"shardwise.checkpoint.{call}() has no {name} argument (torch DCP's extension point): "
                        f"{_WAYS[name]}")


def checkpoint_path(call: str, path: str | os.PathLike | None,
                    checkpoint_id: str | os.PathLike | None) -> str | os.PathLike:
    """The checkpoint's path from the positional ``path`` or DCP's ``checkpoint_id``."""
    if path is not None and checkpoint_id is not None and os.fspath(path) != os.fspath(checkpoint_id):
        raise TypeError(f"shardwise.checkpoint.{call}() got two paths: {os.fspath(path)!r} and checkpoint_id="
                        f"{os.fspath(checkpoint_id)!r}; pass one of them")
    found = path if path is not None else checkpoint_id
    if found is None:
        raise TypeError(f"shardwise.checkpoint.{call}() needs the checkpoint's path: {call}(state, 'ckpt/step-100') "
                        f"or {call}(state, checkpoint_id='ckpt/step-100')")
    return found


def _check_group(call: str, process_group: Any) -> None:
    if process_group is None or not (dist.is_available() and dist.is_initialized()):
        return
    if process_group is dist.GroupMember.WORLD or dist.get_world_size(process_group) == dist.get_world_size():
        return
    raise ValueError(f"shardwise.checkpoint.{call}(): process_group has {dist.get_world_size(process_group)} of the "
                     f"{dist.get_world_size()} ranks, but a shardwise checkpoint is written and read by every rank "
                     "(each piece of data by one rank that holds it, so HSDP replicas need no group of their own): "
                     "call it on every rank with process_group=None")


@contextlib.contextmanager
def dcp_scope(call: str, process_group: Any = None, no_dist: bool = False) -> Iterator[None]:
    """Run a checkpoint call with DCP's ``process_group`` / ``no_dist`` meanings (see above)."""
    if not isinstance(no_dist, bool):
        raise TypeError(f"shardwise.checkpoint.{call}(): no_dist must be a bool, got {no_dist!r}")
    if not no_dist:
        _check_group(call, process_group)
    with alone(no_dist):
        yield


def check_alone_state(call: str, state: Any, no_dist: bool) -> None:
    """With ``no_dist``, refuse a DTensor spread over several ranks (this process holds only
    part of it, and no other rank takes part)."""
    if not no_dist:
        return
    for leaf in flatten(state):
        v = leaf.value
        if isinstance(v, DTensor) and v.device_mesh.size() > 1:
            raise ValueError(f"shardwise.checkpoint.{call}(no_dist=True) runs in this process alone, but the DTensor "
                             f"at '{leaf.key}' is spread over {v.device_mesh.size()} ranks: call {call} on every rank "
                             "without no_dist, or pass full tensors (StateDictOptions(full_state_dict=True))")


class _Folder:
    """What DCP's folder writer and reader share: the path they stand for (``checkpoint_id``),
    and ``reset`` pointing them at another."""

    path: str | os.PathLike

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """DCP's ``reset``: point at ``checkpoint_id`` (when given)."""
        if checkpoint_id:
            self.path = checkpoint_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({os.fspath(self.path)!r})"


def _format_name(value: Any) -> str:
    return str(getattr(value, "name", value)).upper()


class FileSystemWriter(_Folder):
    """``save(state, storage_writer=FileSystemWriter(path))`` is ``save(state, path)``.

    DCP's constructor arguments (torch 2.13): ``single_file_per_rank`` (True: one data file per
    rank, what shardwise always writes; False is refused), ``sync_files`` (accepted; files are
    always synced, the atomic commit needs it), ``thread_count`` and ``per_thread_copy_ahead``
    (accepted and unused: each rank streams its file in one thread), ``cache_staged_state_dict``
    (accepted and unused: ``async_save`` copies the state to CPU memory anew each time),
    ``overwrite`` (True: a save replaces the checkpoint at ``path``; False is refused),
    ``_extensions`` (None only) and ``serialization_format`` (``TORCH_SAVE`` or
    ``SAFETENSORS``: both mean shardwise's safetensors format). A refusal is a ``ValueError``
    naming the argument.
    """

    def __init__(self, path: str | os.PathLike, single_file_per_rank: bool = True, sync_files: bool = True,
                 thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000,
                 cache_staged_state_dict: bool = False, overwrite: bool = True, _extensions: Any = None,
                 serialization_format: Any = "TORCH_SAVE") -> None:
        refused = {"single_file_per_rank": (single_file_per_rank is not True, "shardwise writes one file per rank"),
                   "overwrite": (overwrite is not True, "a shardwise save replaces the checkpoint at its path "
                                 "atomically; check for it yourself (os.path.exists) to keep an old one"),
                   "_extensions": (_extensions is not None, "shardwise data files are plain safetensors, checksummed; "
                                   "it has no stream transforms"),
                   "serialization_format": (_format_name(serialization_format) not in ("TORCH_SAVE", "SAFETENSORS"),
                                            "shardwise writes safetensors")}
        for name, (bad, why) in refused.items():
            if bad:
                raise ValueError(f"shardwise.checkpoint.FileSystemWriter({name}=...): {why}")
        if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"shardwise.checkpoint.FileSystemWriter(thread_count=...) must be an int >= 1, got "
                             f"{thread_count!r}")
        self.path = path
        self.sync_files, self.thread_count, self.per_thread_copy_ahead = sync_files, thread_count, per_thread_copy_ahead
        self.cache_staged_state_dict, self.overwrite = cache_staged_state_dict, overwrite


class FileSystemReader(_Folder):
    """``load(state, storage_reader=FileSystemReader(path))`` is ``load(state, path)``.

    DCP's constructor arguments (torch 2.13): ``path`` and ``_extension_registry`` (None only:
    shardwise data files have no stream transforms; anything else is a ``ValueError`` naming it).
    """

    def __init__(self, path: str | os.PathLike, _extension_registry: Any = None) -> None:
        if _extension_registry is not None:
            raise ValueError("shardwise.checkpoint.FileSystemReader(_extension_registry=...): shardwise data files "
                             "are plain safetensors, checksummed; it has no stream transforms")
        self.path = path



class DefaultSavePlanner:
    """``save(state, path, planner=DefaultSavePlanner())`` is ``save(state, path)``: DCP's default
    planner. torch 2.13's arguments: ``flatten_state_dict`` / ``flatten_sharded_tensors`` True
    only (else a ``ValueError`` naming it), the others accepted (every piece is written once
    anyway, by one rank that holds it). A subclass is a custom planner, refused."""

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 dedup_replicated_tensors: bool | None = None, dedup_save_to_lowest_rank: bool = False,
                 enable_plan_caching: bool = False, allow_partial_load: bool = False) -> None:
        for name, value in (("flatten_state_dict", flatten_state_dict),
                            ("flatten_sharded_tensors", flatten_sharded_tensors)):
            if value is not True:
                raise ValueError(f"shardwise.checkpoint.{type(self).__name__}({name}=...): shardwise always keys a "
                                 "checkpoint by the flattened state's paths; leave it True")
        self.allow_partial_load = allow_partial_load


class DefaultLoadPlanner(DefaultSavePlanner):
    """``load(state, path, planner=DefaultLoadPlanner())`` is ``load(state, path)``; with
    ``allow_partial_load=True`` it is ``strict=False`` (keys the checkpoint lacks keep their
    values). Arguments as `DefaultSavePlanner`'s."""

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 allow_partial_load: bool = False) -> None:
        super().__init__(flatten_state_dict, flatten_sharded_tensors, allow_partial_load=allow_partial_load)
