"""Issue 20 item 1: a second job loading ``latest`` while training replaces it, in a loop.

A real writer process saves ``latest`` over and over (each version's tensors all hold its
number); this process loads it in a loop meanwhile, with ``verify`` on and off. Every load must
return one whole version, or fail with the "being replaced ... retry" error: never a mix of two
versions, never a (false) checksum mismatch, and the writer must never trip over a reader.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from shardwise.checkpoint import CheckpointError, load

VERSIONS = 40
SHAPES = {"a": (256, 256), "b": (512, 128), "c": (64, 1024)}  # ~1 MiB of data per version

WRITER = f"""
import sys, torch
from shardwise.checkpoint import save
path = sys.argv[1]
for v in range(1, {VERSIONS} + 1):
    save({{k: torch.full(s, float(v)) for k, s in {SHAPES!r}.items()}} | {{"version": v}}, path)
    print(v, flush=True)
"""


def load_while_writing(writer: subprocess.Popen, path: str, shapes: dict, timeout: float):
    """Load ``path`` in a loop (verify on and off in turn) while ``writer`` replaces it with
    versions whose every tensor of ``shapes`` is filled with the version number. A load either
    gets one whole version or a "being replaced, retry" error; anything else fails. Returns
    ``(versions loaded, retry messages, writer stdout, writer stderr)``. Also used for S3
    (tests/test_checkpoint_s3.py)."""
    loads, retries, verify = [], [], False
    deadline = time.monotonic() + timeout
    try:
        while writer.poll() is None and time.monotonic() < deadline:
            verify = not verify
            got = {k: torch.zeros(s) for k, s in shapes.items()} | {"version": 0}
            try:
                load(got, path, verify=verify)
            except CheckpointError as e:
                assert "being replaced" in str(e) and "retry" in str(e), f"verify={verify}: {e}"
                retries.append(str(e))
                continue
            v = got["version"]
            mixed = [k for k in shapes if not torch.equal(got[k], torch.full(shapes[k], float(v)))]
            assert not mixed, f"verify={verify}: version {v} with tensors {mixed} of another version"
            loads.append(v)
    finally:
        out, err = writer.communicate(timeout=timeout)
    return loads, retries, out, err


def test_a_reader_sees_one_whole_version_or_a_retry_while_a_writer_replaces(tmp_path):
    path = str(tmp_path / "latest")
    first = subprocess.run([sys.executable, "-c", WRITER.replace(f"{VERSIONS} + 1", "2"), path], capture_output=True,
                           text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    writer = subprocess.Popen([sys.executable, "-c", WRITER, path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    loads, retries, out, err = load_while_writing(writer, path, SHAPES, 240)
    assert writer.returncode == 0, f"the writer failed (a reader got in its way?): {err[-2000:]}"
    assert len(loads) >= 10 and len(set(loads)) >= 3, (loads, len(retries))
    assert sorted(os.listdir(tmp_path)) == [".shardwise-series.json", "latest"], os.listdir(tmp_path)
    print(f"{len(loads)} whole loads of {len(set(loads))} versions, {len(retries)} retries")


def test_a_checkpoint_renamed_into_place_while_a_load_opens_it_is_loaded(tmp_path, monkeypatch):
    """The race the S3 reader test met under load: the load opens ``latest`` between the two
    renames of a replace (no index there: `IndexMissing`), and by the time it looks again the
    new version is in place. The load retries and reads it; before, it reported that the
    checkpoint does not exist."""
    from shardwise.checkpoint import save
    from shardwise.checkpoint._base import IndexMissing
    from shardwise.checkpoint._load import _reader

    path = str(tmp_path / "latest")
    save({k: torch.full(s, 3.0) for k, s in SHAPES.items()} | {"version": 3}, path)
    real, opened = _reader.open_checkpoint, []

    def between_renames(source, storage):
        opened.append(source)
        if len(opened) == 1:
            raise IndexMissing(f"{source} does not exist")
        return real(source, storage)

    monkeypatch.setattr(_reader, "open_checkpoint", between_renames)
    got = {k: torch.zeros(s) for k, s in SHAPES.items()} | {"version": 0}
    load(got, path)
    assert got["version"] == 3 and len(opened) == 2, (got["version"], opened)
    assert all(torch.equal(got[k], torch.full(s, 3.0)) for k, s in SHAPES.items())
