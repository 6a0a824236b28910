"""Checks of ``examples/train.py``'s arguments that run before anything is built.

Everything here reads only the parsed arguments, the world size torchrun announces
(``WORLD_SIZE``, 1 when unset) and, for ``--resume``, the checkpoint's ``index.json``
(the documented format of docs/checkpoint-format.md): no process group, mesh, model or
tensor exists yet. A bad argument is a `UsageError` with a one-line message that names
the valid values; ``train.py`` prints it on rank 0 only and exits with status 2, so a
mistake costs a second, not a model build and a traceback per rank.

[Note: why read index.json here]
``checkpoint.load`` refuses every non-checkpoint with a clear message, but only after the
model is built and sharded, on every rank. The example needs two facts before building:
that ``--resume`` is a complete checkpoint of this script, and its step (to tell the user
when ``--steps`` leaves nothing to train). Both are in the index.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

__all__ = ["UsageError", "Preflight", "preflight", "divisors", "resume_step", "MODEL_ARGS"]

# The arguments that fix the shapes of the model: a checkpoint only resumes with the same ones.
MODEL_ARGS = ("dim", "layers", "heads", "kv_heads", "vocab")


class UsageError(ValueError):
    """A bad command line; the message is one line meant for the user."""


@dataclass(frozen=True)
class Preflight:
    """What the checks worked out: ``dp_shard`` resolved, the data-parallel size, and the
    step of the ``--resume`` checkpoint (None without ``--resume``)."""

    world_size: int
    dp_shard: int
    dp_size: int
    resume_step: int | None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_layout(world: int, dp_replicate: int, dp_shard: int, tp: int, what: str | None = None) -> int:
    """Resolve ``dp_shard=-1``; check ``dp_replicate * dp_shard * tp == world``. ``what``: how
    to name ``world`` in messages (default "the world size N")."""
    what = what or f"the world size {world}"
    whole = what.rsplit(" = ", 1)[0] if " = " in what else "the world size"
    if tp < 1 or world % tp:
        raise UsageError(f"--tp {tp} does not divide {what}; "
                         f"valid --tp values on {world} ranks: {', '.join(map(str, divisors(world)))}")
    rest = world // tp
    if dp_replicate < 1 or rest % dp_replicate:
        raise UsageError(f"--dp-replicate {dp_replicate} does not divide {what} / --tp {tp} = {rest}; "
                         f"valid --dp-replicate values: {', '.join(map(str, divisors(rest)))}")
    want = rest // dp_replicate
    if dp_shard == -1:
        return want
    if dp_shard != want:
        raise UsageError(f"--dp-replicate {dp_replicate} x --dp-shard {dp_shard} x --tp {tp} = "
                         f"{dp_replicate * dp_shard * tp} ranks, but {whole} {'leaves' if '/' in whole else 'is'} "
                         f"{world}; "
                         f"valid --dp-shard values here: {want} or -1 (the rest)")
    return dp_shard


def _check_model(args: argparse.Namespace) -> None:
    """The shapes ``LlamaConfig`` and the TP plan accept, checked with the valid values."""
    positive = ("steps", "dim", "layers", "heads", "vocab", "seq_len", "batch_size", "log_every", "threads")
    for name in positive:
        if getattr(args, name) < 1:
            raise UsageError(f"{_flag(name)} {getattr(args, name)}: must be >= 1")
    if args.dim % args.heads or (args.dim // args.heads) % 2:
        ok = [h for h in divisors(args.dim) if (args.dim // h) % 2 == 0]
        raise UsageError(f"--heads {args.heads} must divide --dim {args.dim} into an even head width; "
                         f"valid --heads values: {', '.join(map(str, ok))}")
    kv = args.heads if args.kv_heads is None else args.kv_heads
    if kv < 1 or args.heads % kv:
        raise UsageError(f"--kv-heads {kv} does not divide --heads {args.heads}; "
                         f"valid --kv-heads values: {', '.join(map(str, divisors(args.heads)))}")


class _Folders:
    """The few file-system questions `resume_step` asks, of the local disk or (a URL such as
    ``s3://bucket/run/step-3``) of the fsspec file system serving it."""

    def __init__(self, path: str) -> None:
        self.fs = None
        if "://" in path:
            import fsspec

            self.fs = fsspec.core.url_to_fs(path)[0]

    def abspath(self, path: str) -> str:
        return os.path.abspath(path) if self.fs is None else path.rstrip("/")

    def exists(self, path: str) -> bool:
        return os.path.exists(path) if self.fs is None else self.fs.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path) if self.fs is None else self.fs.isdir(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path) if self.fs is None else self.fs.isfile(path)

    def listdir(self, path: str) -> list[str]:
        if self.fs is None:
            return os.listdir(path)
        return [os.path.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False)]

    def read_text(self, path: str) -> str:
        if self.fs is None:
            with open(path) as f:
                return f.read()
        return self.fs.cat_file(path).decode("utf-8")


def _complete_checkpoints_near(path: str) -> list[str]:
    disk = _Folders(path)
    parent = os.path.dirname(disk.abspath(path)) or "."
    try:
        names = sorted(disk.listdir(parent))
    except OSError:
        return []
    return [os.path.join(os.path.dirname(path), n) for n in names
            if not n.startswith(".") and disk.isfile(os.path.join(parent, n, "index.json"))]


def _not_a_checkpoint(path: str, why: str) -> UsageError:
    near = _complete_checkpoints_near(path)
    hint = (f"checkpoints next to it: {', '.join(near[:5])}" if near else
            "pass a folder written by examples/train.py --save DIR")
    return UsageError(f"--resume {path}: {why}; {hint}")


def resume_step(path: str, args: argparse.Namespace) -> int:
    """The step the ``--resume`` checkpoint at ``path`` was saved at, after checking that it is
    a complete checkpoint of this script with the model arguments of ``args``."""
    disk = _Folders(path)
    base = os.path.basename(os.path.normpath(path))
    if ".incomplete-" in base:
        raise _not_a_checkpoint(path, "is an incomplete save (the saving job stopped before committing it)")
    if not disk.exists(path):
        parent = os.path.dirname(disk.abspath(path))
        left = [n for n in (disk.listdir(parent) if disk.isdir(parent) else [])
                if n.startswith(f".{base}.incomplete-")]
        why = (f"does not exist; a save to it stopped before committing ({left[0]} is left over)" if left
               else "does not exist")
        raise _not_a_checkpoint(path, why)
    if not disk.isdir(path):
        raise _not_a_checkpoint(path, "is a file, not a checkpoint folder")
    names = disk.listdir(path)
    if not names:
        raise _not_a_checkpoint(path, "is an empty folder")
    index = os.path.join(path, "index.json")
    if not disk.isfile(index):
        if "config.json" in names or any(n.endswith(".safetensors") for n in names):
            why = ("is a Hugging Face folder (safetensors/config.json, no index.json), not a training checkpoint; "
                   "load weights from it with shardwise.checkpoint.load_safetensors")
        else:
            why = f"has no index.json, so it is not a shardwise checkpoint (it holds {sorted(names)[:5]})"
        raise _not_a_checkpoint(path, why)
    try:
        raw = json.loads(disk.read_text(index))
        if isinstance(raw, dict) and raw.get("version") == 3 and isinstance(raw.get("at"), str):
            # a pointer to the save's own folder (an object store: docs/checkpoint-format.md)
            raw = json.loads(disk.read_text(os.path.join(path, raw["at"], "index.json")))
    except (OSError, ValueError) as e:
        raise _not_a_checkpoint(path, f"its index.json is unreadable ({type(e).__name__})") from None
    values = raw.get("values", {}) if isinstance(raw, dict) else {}
    if not isinstance(raw, dict) or raw.get("format") != "shardwise.checkpoint":
        raise _not_a_checkpoint(path, "its index.json is not a shardwise checkpoint index")
    if not isinstance(values.get("trainer/step"), int):
        raise _not_a_checkpoint(path, "is a shardwise checkpoint, but not one saved by examples/train.py "
                                      "(no trainer/step)")
    for name in MODEL_ARGS:  # saved as the plain values trainer/model_args/<name>
        key = f"trainer/model_args/{name}"
        if key in values and values[key] != getattr(args, name):
            raise UsageError(f"--resume {path} holds a model with {_flag(name)} {values[key]}, not "
                             f"{getattr(args, name)}; pass {_flag(name)} {values[key]}")
    return values["trainer/step"]


def preflight(args: argparse.Namespace, world_size: int) -> Preflight:
    """Check ``args`` for a job of ``world_size`` ranks; raise `UsageError` on the first problem."""
    _check_model(args)
    pp = getattr(args, "pp", 1)  # pipeline stages: the outermost axis; each stage has world/pp ranks
    if pp < 1 or world_size % pp:
        raise UsageError(f"--pp {pp} does not divide the world size {world_size}; valid --pp values: "
                         f"{', '.join(map(str, divisors(world_size)))}")
    stage_world = world_size // pp
    cp = getattr(args, "cp", 1)  # --cp: world_size is already the ranks of one cp slot (examples/cp.py cp_world)
    what = None if cp == 1 else (f"the world size {world_size * cp} / --cp {cp}"
                                 f"{f' / --pp {pp}' if pp > 1 else ''} = {stage_world}")
    if what is None and pp > 1:
        what = f"the world size {world_size} / --pp {pp} = {stage_world}"
    dp_shard = _check_layout(stage_world, args.dp_replicate, args.dp_shard, args.tp, what)
    kv = args.heads if args.kv_heads is None else args.kv_heads
    if kv % args.tp:  # tensor parallelism splits the heads
        ok = [d for d in divisors(stage_world) if kv % d == 0]
        raise UsageError(f"--tp {args.tp} does not divide the {kv} key/value heads (--kv-heads, default --heads); "
                         f"valid --tp values on {stage_world} ranks: {', '.join(map(str, ok))}")
    dp_size = args.dp_replicate * dp_shard
    per_step = dp_size
    if pp > 1:
        virtual = args.virtual_stages or (2 if args.schedule == "interleaved_1f1b" else 1)
        if args.layers < pp * virtual:
            raise UsageError(f"--layers {args.layers} is fewer than the {pp * virtual} pipeline stages (--pp {pp} x "
                             f"{virtual} per rank); use --layers >= {pp * virtual} or a smaller --pp")
        per_step = dp_size * (args.microbatches or 2 * pp)  # every dp rank splits its rows into microbatches
    if args.batch_size % per_step:
        what = (f"the data-parallel size {dp_size} (--dp-replicate {args.dp_replicate} x --dp-shard {dp_shard})"
                if per_step == dp_size else f"data-parallel size {dp_size} x microbatches {per_step // dp_size}")
        raise UsageError(f"--batch-size {args.batch_size} is not divisible by {what}; valid --batch-size values: "
                         f"multiples of {per_step}, e.g. {per_step * max(1, args.batch_size // per_step)} or "
                         f"{per_step * (args.batch_size // per_step + 1)}")
    step = resume_step(args.resume, args) if args.resume else None
    return Preflight(world_size, dp_shard, dp_size, step)
