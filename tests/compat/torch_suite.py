"""Rerun torch's own FSDP2 / TP unit tests with torch's names rebound to shardwise's (issue 33:
"torch's own FSDP2/TP unit tests still pass as before").

Not a pytest module (pytest collects ``test_*.py`` only) and not in the suite: torch's test files
are not in the installed wheel and are not in this repository (no copied code). Get them from
the pytorch/pytorch repository (``test/distributed/_composable/fsdp/test_fully_shard_*.py``,
``test/distributed/tensor/parallel/test_tp_*.py``, ``test_parallelize_api.py``, keeping the
``test/distributed/...`` layout under one folder), install what torch's test files import
(``pip install -e '.[torch-suite]'``: expecttest, not in the suite's extras), then::

    python -m tests.compat.torch_suite /path/to/pytorch [--only SUBSTRING] [-k EXPR] [--timeout 900]

from the repository root. Each test file found under ``PATH`` (``--only``: whose path contains
the substring; ``-k``: pytest's selection inside each file) is run twice, at the same time,
with pytest in two fresh interpreters, cwd = the file's folder:

- ``torch``: as is;
- ``shardwise``: `tests/compat/_rebind.py`'s ``rebind_to_shardwise()`` runs at interpreter
  start (a ``sitecustomize`` module this runner writes to a temporary folder put first on
  ``PYTHONPATH``), before the test file is imported, in the pytest process and in every rank
  that torch's ``MultiProcessTestCase`` spawns; torch's threads-as-ranks tests
  (``MultiThreadedTestCase``) and local-tensor tests (one process) share that process's
  rebinding.

Then it prints one row per test: ``pass`` / ``FAIL`` / ``skip`` / ``error`` on torch and on
shardwise, the skip reason (most of torch's FSDP2 tests need ``torch.accelerator`` devices:
`FSDPTest` exits with "Need at least N CUDA devices" when ``device_count() < world_size``, 0 on
a CPU host), and for each test passing on torch but not on shardwise, the first line of its
error. The counts close the table; ``--json FILE`` writes the rows.

One compatibility shim, in both runs alike: test files newer than the installed torch may import
``HardwareClassification`` from ``torch.testing._internal.common_utils`` (a label that
torch > 2.13 puts on test classes; 2.13 has none); when the installed torch lacks it, the
``sitecustomize`` adds a class of that name whose every attribute is its own name, after
the module loads. Nothing else of torch's
tests or test helpers is changed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATTERNS = ("test/distributed/_composable/fsdp/test_fully_shard_*.py",
            "test/distributed/tensor/parallel/test_tp_*.py",
            "test/distributed/tensor/parallel/test_parallelize_api.py")
ENV = "SHARDWISE_TORCH_SUITE"

SITECUSTOMIZE = f'''
import os as _os
import sys as _sys

if _os.environ.get("{ENV}"):
    import importlib.abc as _abc
    import importlib.machinery as _machinery

    _NAME = "torch.testing._internal.common_utils"

    class _Labels(type):  # any label: HardwareClassification.ACCELERATOR == "ACCELERATOR"
        def __getattr__(cls, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return name

    def _shim(module):
        if not hasattr(module, "HardwareClassification"):
            module.HardwareClassification = _Labels("HardwareClassification", (), {{}})

    class _After(_abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != _NAME:
                return None
            spec = _machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _shim(module)

            spec.loader.exec_module = exec_module
            return spec

    _sys.meta_path.insert(0, _After())
    if _os.environ["{ENV}"] == "shardwise":
        from tests.compat._rebind import rebind_to_shardwise

        rebind_to_shardwise()
'''


def find_files(path: pathlib.Path, only: str | None) -> list[pathlib.Path]:
    files = sorted({f for pattern in PATTERNS for f in path.glob(pattern)})
    return [f for f in files if only is None or only in str(f)]


def _outcomes(xml_path: pathlib.Path) -> dict[str, tuple[str, str]]:
    """``{Class::test: (outcome, first line of the reason)}`` from pytest's JUnit XML."""
    out: dict[str, tuple[str, str]] = {}
    if not xml_path.exists():
        return out
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, reason = "pass", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "FAIL", "error": "error", "skipped": "skip"}[child.tag]
                # the body holds the traceback (for thread-ranks, the rank's own after
                # "Thread N exited with exception:"); the message attribute only its first line
                reason = _first_line(f"{child.get('message') or ''}\n{child.text or ''}")
                break
        out[name] = (outcome, reason)
    return out


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # prefer the exception line of a traceback (the last "SomethingError: ..." line)
    errors = [ln for ln in lines if ln.split(":", 1)[0].split(".")[-1].endswith(("Error", "Exception", "Failure"))
              and "exited with exception" not in ln]
    line = errors[-1] if errors else (lines[0] if lines else "")
    line = line[2:].strip() if line.startswith("E ") else line
    return line[:200]


def run_file(test_file: pathlib.Path, impl: str, site_dir: str, timeout: float,
             select: str | None = None) -> dict[str, tuple[str, str]]:
    """Runs one torch test file with pytest under ``impl``; its per-test outcomes."""
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as tmp:
        xml_path = pathlib.Path(tmp) / "junit.xml"
        env = dict(os.environ)
        env[ENV] = impl
        env["PYTHONPATH"] = os.pathsep.join([site_dir, str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml_path}",
               "-o", "junit_family=xunit1", test_file.name] + (["-k", select] if select else [])
        try:
            proc = subprocess.run(cmd, cwd=test_file.parent, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            tail = proc.stdout[-2000:] + proc.stderr[-2000:]
        except subprocess.TimeoutExpired:
            tail = f"the file did not finish within {timeout:.0f} s"
        out = _outcomes(xml_path)
        if not out:  # the file did not import or pytest died: one row for the file
            out[f"{test_file.name}::<file>"] = ("error", _first_line(tail))
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=pathlib.Path, help="a folder holding torch's test/distributed/... files")
    parser.add_argument("--only", help="run the files whose path contains this")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per file and implementation")
    parser.add_argument("-k", dest="select", help="pytest's -k expression: run only the tests it selects")
    parser.add_argument("--json", type=pathlib.Path, help="write the rows to this file")
    args = parser.parse_args(argv)
    files = find_files(args.path, args.only)
    if not files:
        parser.error(f"no torch test files under {args.path} (looked for {', '.join(PATTERNS)})")
    rows = []
    with tempfile.TemporaryDirectory(prefix="torch-suite-site-") as site_dir:
        pathlib.Path(site_dir, "sitecustomize.py").write_text(SITECUSTOMIZE)
        for f in files:
            started = time.monotonic()
            with ThreadPoolExecutor(2) as pool:  # both implementations at once, each in its own interpreter
                runs = {impl: pool.submit(run_file, f, impl, site_dir, args.timeout, args.select)
                        for impl in ("torch", "shardwise")}
                got = {impl: run.result() for impl, run in runs.items()}
            names = sorted(set(got["torch"]) | set(got["shardwise"]))
            for name in names:
                t = got["torch"].get(name, ("absent", ""))
                s = got["shardwise"].get(name, ("absent", ""))
                rows.append({"file": f.name, "test": name, "torch": t[0], "shardwise": s[0],
                             "torch_reason": t[1], "shardwise_reason": s[1]})
            print(f"# {f.relative_to(args.path)}: {len(names)} tests, {time.monotonic() - started:.0f} s",
                  file=sys.stderr, flush=True)
    _print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    regressions = [r for r in rows if r["torch"] == "pass" and r["shardwise"] != "pass"]
    return 1 if regressions else 0


def _print_table(rows: list[dict]) -> None:
    width = max((len(r["file"]) + len(r["test"]) + 2 for r in rows), default=10)
    for r in rows:
        note = ""
        if r["torch"] == "pass" and r["shardwise"] != "pass":
            note = r["shardwise_reason"]
        elif r["torch"] == "skip":
            note = r["torch_reason"]
        elif r["torch"] != "pass":
            note = "torch: " + r["torch_reason"]
        print(f"{r['file'] + '::' + r['test']:<{width}}  {r['torch']:<6} {r['shardwise']:<6} {note}")
    counts: dict[tuple[str, str], int] = {}
    for r in rows:
        counts[(r["torch"], r["shardwise"])] = counts.get((r["torch"], r["shardwise"]), 0) + 1
    print(f"\n{len(rows)} tests: " + ", ".join(f"{n} torch {t} / shardwise {s}"
                                             for (t, s), n in sorted(counts.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    raise SystemExit(main())
