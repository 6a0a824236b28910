"""The command line: ``python -m shardwise.checkpoint`` or ``shardwise-checkpoint``.

    inspect DIR [--json]                 tensors, layouts, sizes, the world size it came from
    verify DIR                           every box present, sizes and checksums match (exit 1 if not)
    merge DIR OUT [--config C] [--prefix P] [--max-shard-size 5GB] [--replace]
                                         full tensors; with --config a save_pretrained folder
    reshard DIR OUT --world-size N [--replace]
                                         a checkpoint laid out for N ranks
    import-dcp SRC DST [--replace]       a torch DCP checkpoint directory as a verified shardwise checkpoint

Every command works on one machine without torch.distributed. Exit status: 0 when all is
well; 1 on any problem, each printed as one line on stderr that names the file and the
problem (never a traceback: an unexpected exception is one line too); 2 for wrong usage;
3 from ``verify`` when no problem was found but something could not be checked (a box or
an index without a checksum). ``inspect`` reads only the index and the data files' sizes
and headers (never their data) and exits 1 if those show a problem.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from datetime import datetime, timezone

from ._dcp_import import add_import_dcp
from ._base import CheckpointError
from ._format import Index, dtype_name, open_checkpoint
from ._offline import file_problems, merge_checkpoint, reshard_checkpoint, verify_checkpoint

__all__ = ["main"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB, 500MB or 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _layout(layout: dict | None) -> str:
    if layout is None:
        return "plain"
    names = layout.get("mesh_dim_names")
    mesh = "x".join(map(str, layout["mesh_shape"]))
    axes = f" {tuple(names)}" if names else ""
    return f"mesh {mesh}{axes} {', '.join(layout['placements'])}"


def _summary(index: Index, where: str) -> dict:
    return {
        "path": where,
        "format_version": index.version,
        "created": (datetime.fromtimestamp(index.created_unix_ns / 1e9, timezone.utc).isoformat()
                    if index.created_unix_ns else None),
        "saved_from_world_size": index.world_size,
        "files": len(index.files),
        "bytes": sum(v or 0 for v in index.files.values()),
        "layouts": dict(Counter(_layout(t.layout) for t in index.tensors.values())),
        "tensors": {k: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "layout": _layout(t.layout),
                        "boxes": len(t.boxes), "bytes": t.nbytes} for k, t in index.tensors.items()},
        "values": sorted(index.values),
    }


def _inspect(args) -> int:
    path = args.path if "://" in args.path else os.path.abspath(args.path)
    with open_checkpoint(path) as files:  # reads the index, sizes and headers: never the data
        problems, _, _ = file_problems(files, checksums=False)
        s = _summary(files.index, files.where)
    if problems:
        for p in problems:
            _error(p)
        return 1
    if args.json:
        print(json.dumps(s, indent=1))
        return 0
    print(f"checkpoint {s['path']}")
    print(f"  format version {s['format_version']}, created {s['created']}, saved by "
          f"{s['saved_from_world_size']} ranks")
    print(f"  {s['files']} data files, {_human(s['bytes'])}; {len(s['tensors'])} tensors")
    print("  layouts saved from:")
    for layout, n in s["layouts"].items():
        print(f"    {n:5d} x {layout}")
    width = max((len(k) for k in s["tensors"]), default=0)
    for k, t in s["tensors"].items():
        print(f"  {k:<{width}}  {t['dtype']:<9} {str(t['shape']):<16} {_human(t['bytes']):>9}  "
              f"{t['boxes']} boxes  {t['layout']}")
    if s["values"]:
        print(f"  plain values: {', '.join(s['values'])}")
    return 0


def _verify(args) -> int:
    report = verify_checkpoint(args.path)
    if report.fully_checked:
        print(f"OK {report.path}: {report.tensors} tensors, {report.boxes} boxes, "
              f"{_human(report.bytes_checked)} checksummed")
        return 0
    for p in report.problems:
        _error(p)
    for u in report.unchecked:
        _error(f"NOT CHECKED: {u}")
    if report.problems:
        return 1
    print(f"NOT FULLY CHECKED {report.path}: no problem found in what could be checked ({report.tensors} tensors, "
          f"{_human(report.bytes_checked)} checksummed), but {len(report.unchecked)} parts have no checksum")
    return 3


def _progress(args) -> bool:
    return not args.no_progress and sys.stderr.isatty()


def _merge(args) -> int:
    names = merge_checkpoint(args.path, args.out, prefix=args.prefix, config=args.config,
                             max_shard_bytes=args.max_shard_size, progress=_progress(args), replace=args.replace)
    out = os.path.abspath(args.out)
    if args.config:
        print(f"wrote a Hugging Face folder to {out}: config.json and {len(names)} safetensors files")
    else:
        print(f"wrote {len(names)} bare safetensors files (tensors-*) to {out}; no config.json, so from_pretrained "
              "cannot read it: pass --config for a save_pretrained folder")
    return 0


def _reshard(args) -> int:
    reshard_checkpoint(args.path, args.out, args.world_size, progress=_progress(args), replace=args.replace)
    print(f"wrote a checkpoint for {args.world_size} ranks to {os.path.abspath(args.out)}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise-checkpoint", description="Inspect, verify, merge and reshard "
                                "shardwise checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("inspect", help="list tensors, layouts and sizes")
    c.add_argument("path")
    c.add_argument("--json", action="store_true", help="print the summary as JSON")
    c.set_defaults(run=_inspect)
    c = sub.add_parser("verify", help="check every box, file size and checksum")
    c.add_argument("path")
    c.set_defaults(run=_verify)
    c = sub.add_parser("merge", help="write full tensors as Hugging Face style safetensors")
    c.add_argument("path")
    c.add_argument("out")
    c.add_argument("--prefix", default=None, help="only tensors whose key starts with this, with it stripped "
                   "(default: 'model/' when there are such tensors)")
    c.add_argument("--config", default=None, help="config.json (or the model folder holding it) to write a "
                   "complete, checked save_pretrained folder; without it bare tensors-*.safetensors files")
    c.add_argument("--max-shard-size", type=_size, default=5 * 10**9, help="bytes per output file (default 5GB)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar (none when stderr is not a terminal)")
    c.add_argument("--replace", action="store_true", help="replace OUT if it is an earlier merge output (files added "
                   "to it are kept)")
    c.set_defaults(run=_merge)
    c = sub.add_parser("reshard", help="rewrite for another number of ranks (dim-0 shards)")
    c.add_argument("path")
    c.add_argument("out")
    c.add_argument("--world-size", type=int, required=True)
    c.add_argument("--no-progress", action="store_true")
    c.add_argument("--replace", action="store_true", help="replace OUT if it is a shardwise checkpoint")
    c.set_defaults(run=_reshard)
    add_import_dcp(sub)
    return p


def _error(message: str) -> None:
    """One line on stderr (a message of several lines is joined)."""
    print("error: " + " ".join(part.strip() for part in str(message).splitlines()), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except CheckpointError as e:
        _error(str(e))
    except OSError as e:
        _error(f"{e.filename or args.path}: {e.strerror or type(e).__name__}")
    except (Exception, RecursionError) as e:  # e.g. MemoryError: still one line, never a traceback
        _error(f"{args.path}: {type(e).__name__} while running {args.command} (a damaged checkpoint? run verify)")
    return 1
