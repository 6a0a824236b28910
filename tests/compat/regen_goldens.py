"""Regenerate the golden data of tests/compat (the torch side of the differential tests;
`tests/compat/_golden.py` says what they are).

    python -m tests.compat.regen_goldens            # every golden
    python -m tests.compat.regen_goldens NAME ...   # those
    python -m tests.compat.regen_goldens --list     # the names, their modules and clients

Run it after changing a pinned release (torch's or a client's) or a recorded scenario, from the
repository root, with the README's test install; then run the tests and commit the files.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import pathlib

from tests.compat._golden import load_recorders, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.compat.regen_goldens", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="goldens to regenerate (default: all)")
    parser.add_argument("--list", action="store_true", help="list the goldens and exit")
    args = parser.parse_args(argv)
    recorders = load_recorders()
    if args.list:
        for r in sorted(recorders.values(), key=lambda r: r.name):
            print(f"{r.name}  {r.module}.{r.fn.__qualname__}  clients={','.join(r.clients) or '-'}")
        return 0
    unknown = sorted(set(args.names) - set(recorders))
    if unknown:
        parser.error(f"no golden named {unknown}; --list shows them")
    for name in args.names or sorted(recorders):
        r = recorders[name]
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"golden-{name}-") as tmp:
            path = write(name, r.fn(pathlib.Path(tmp)), r.clients)
        print(f"{name}: {path} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
