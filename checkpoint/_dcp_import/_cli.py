"""The ``import-dcp`` subcommand of ``shardwise-checkpoint`` (registered by ``checkpoint/_cli.py``)."""

from __future__ import annotations

import argparse
import os
import sys

from ._convert import import_dcp

__all__ = ["add_import_dcp"]


def _run(args: argparse.Namespace) -> int:
    stats = import_dcp(args.path, args.out, replace=args.replace,
                       progress=not args.no_progress and sys.stderr.isatty())
    print(f"imported the DCP checkpoint {args.path} (saved by {stats.source_world_size} ranks) into the shardwise "
          f"checkpoint {os.path.abspath(args.out)}: {stats.tensors} tensors in {stats.boxes} boxes "
          f"({stats.bytes_copied / 1e6:.1f} MB), {stats.values} plain values; verified")
    return 0


def add_import_dcp(sub: argparse._SubParsersAction) -> None:
    """Add ``import-dcp SRC DST [--replace] [--no-progress]`` to the subcommands ``sub``."""
    c = sub.add_parser("import-dcp", help="convert a torch DCP checkpoint directory into a shardwise checkpoint")
    c.add_argument("path", metavar="SRC", help="the DCP directory (.metadata and __<rank>_<k>.distcp files)")
    c.add_argument("out", metavar="DST", help="the new shardwise checkpoint (must not exist)")
    c.add_argument("--replace", action="store_true", help="replace DST if it is a shardwise checkpoint")
    c.add_argument("--no-progress", action="store_true", help="no progress bar (none when stderr is not a terminal)")
    c.set_defaults(run=_run)
