"""The same damaged checkpoints against shardwise.checkpoint and torch.distributed.checkpoint (DCP).

    python benchmarks/corruption_vs_dcp.py

One process, no process group (both libraries support that). Each library saves the same small
state (``w``: [8, 3] fp32, ``b``: [5] fp32, ``step``: 3) with its defaults, then every case
damages a fresh copy the same way at the file level (for DCP the pickled ``.metadata`` is
edited with torch's own classes, for shardwise ``index.json``, with its checksum recomputed
where the edit is one a hostile tool would make) and loads it with defaults (shardwise:
``verify=True``) into a target filled with -1. Outcomes per case:

    error       the load raised
    named       ... and its message names the checkpoint or the damaged file
    silent      the load returned but the target does not hold exactly the saved values
    outside     a file outside the checkpoint folder was opened (inotify on the outside folder)
    lost        the case "overwrite_fails": a save over an existing checkpoint fails midway;
                afterwards the old checkpoint no longer loads with its old values

The outside folder holds a valid data file of each library saved from *other* values, so a
load that follows a pointer there returns wrong values silently.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests._corrupt import OutsideWatch  # noqa: E402
import tests._corrupt as sw_cases  # noqa: E402

SAVED = {"w": torch.arange(24.0).reshape(8, 3) / 7, "b": torch.arange(5.0), "step": 3}
OTHER = {"w": torch.full((8, 3), 5.0), "b": torch.full((5,), 5.0), "step": 3}


def _target():
    return {"w": torch.full((8, 3), -1.0), "b": torch.full((5,), -1.0), "step": -1}


def _clone(s):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}


class Shardwise:
    name, index = "shardwise", "index.json"

    def save(self, state, path):
        from shardwise.checkpoint import save
        save(_clone(state), path)

    def load(self, path):
        from shardwise.checkpoint import load
        t = _target()
        load(t, path)
        return t

    def data(self, path):
        return os.path.join(path, "rank-00000.safetensors")

    def point_at(self, path, name):
        sw_cases.edit(path, lambda i: _sw_point(i, name), rehash=True)

    def hole(self, path):
        sw_cases.edit(path, lambda i: i["tensors"]["w"]["boxes"][0].update(sizes=[4, 3]), rehash=True)

    def fail_overwrite(self, path, state):
        import shardwise.checkpoint._save._save_handle as w
        real = w.commit
        w.commit = lambda *a, **k: (_ for _ in ()).throw(OSError("disk full (injected)"))
        try:
            self.save(state, path)
        finally:
            w.commit = real


def _sw_point(index, name):
    old = index["tensors"]["w"]["boxes"][0]["file"]
    index["files"][name] = index["files"].pop(old)
    for t in index["tensors"].values():
        for b in t["boxes"]:
            b["file"] = name if b["file"] == old else b["file"]


class DCP:
    name, index = "torch DCP", ".metadata"

    def save(self, state, path):
        import torch.distributed.checkpoint as dcp
        dcp.save(_clone(state), checkpoint_id=path)

    def load(self, path):
        import torch.distributed.checkpoint as dcp
        t = _target()
        dcp.load(t, checkpoint_id=path)
        return t

    def data(self, path):
        return os.path.join(path, "__0_0.distcp")

    def _edit(self, path, fn):
        file = os.path.join(path, ".metadata")
        with open(file, "rb") as f:
            md = pickle.load(f)
        fn(md)
        with open(file, "wb") as f:
            pickle.dump(md, f)

    def point_at(self, path, name):
        def fn(md):
            for k, info in list(md.storage_data.items()):
                if k.fqn == "w":
                    md.storage_data[k] = replace(info, relative_path=name)
        self._edit(path, fn)

    def hole(self, path):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        def fn(md):
            meta = md.state_dict_metadata["w"]
            meta.chunks[0] = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 3]))
        self._edit(path, fn)

    def fail_overwrite(self, path, state):
        import torch.distributed.checkpoint.filesystem as fs
        real = fs.FileSystemWriter.finish
        fs.FileSystemWriter.finish = lambda *a, **k: (_ for _ in ()).throw(OSError("disk full (injected)"))
        try:
            self.save(state, path)
        finally:
            fs.FileSystemWriter.finish = real


def _flip(file):
    """Flip one bit of one of ``w``'s stored values (found by its bytes, wherever the format puts them)."""
    raw = bytes(SAVED["w"].contiguous().view(torch.uint8).reshape(-1).tolist())
    with open(file, "r+b") as f:
        data = f.read()
        at = data.find(raw)
        assert at >= 0, f"w's bytes not found in {file}"
        f.seek(at + len(raw) // 2)
        f.write(bytes([data[at + len(raw) // 2] ^ 0x10]))


def _text(file):
    size = os.path.getsize(file)
    with open(file, "wb") as f:
        f.write((b"root:x:0:0:root:/root:/bin/bash\n" * (size // 32 + 1))[:size])


CASES = {
    "nonexistent": lambda lib, p, o: shutil.rmtree(p),
    "index_missing": lambda lib, p, o: os.remove(os.path.join(p, lib.index)),
    "index_garbage": lambda lib, p, o: open(os.path.join(p, lib.index), "wb").write(b"\x80garbage{"),
    "index_truncated": lambda lib, p, o: os.truncate(os.path.join(p, lib.index),
                                                     os.path.getsize(os.path.join(p, lib.index)) // 2),
    "data_byte_flip": lambda lib, p, o: _flip(lib.data(p)),
    "data_truncated": lambda lib, p, o: os.truncate(lib.data(p), os.path.getsize(lib.data(p)) - 8),
    "data_missing": lambda lib, p, o: os.remove(lib.data(p)),
    "data_is_text_file": lambda lib, p, o: _text(lib.data(p)),
    "data_symlink_outside": lambda lib, p, o: (os.remove(lib.data(p)),
                                               os.symlink(os.path.join(o, os.path.basename(lib.data(p))),
                                                          lib.data(p))),
    "data_name_dotdot": lambda lib, p, o: lib.point_at(p, f"../outside/{os.path.basename(lib.data(p))}"),
    "data_name_absolute": lambda lib, p, o: lib.point_at(p, os.path.join(o, os.path.basename(lib.data(p)))),
    "index_hole": lambda lib, p, o: lib.hole(p),
    "overwrite_fails": lambda lib, p, o: lib.fail_overwrite(p, OTHER),
}


def _same(t):
    return all(torch.equal(t[k], SAVED[k]) if isinstance(SAVED[k], torch.Tensor) else t[k] == SAVED[k] for k in SAVED)


def run(lib, root):
    rows = {}
    for case, damage in CASES.items():
        base = os.path.join(root, lib.name.replace(" ", "_"), case)
        path, outside = os.path.join(base, "ckpt"), os.path.join(base, "outside")
        lib.save(OTHER, os.path.join(base, "other"))
        os.makedirs(outside)
        shutil.copy(lib.data(os.path.join(base, "other")), outside)
        lib.save(SAVED, path)
        try:
            damage(lib, path, outside)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # the injected failure of overwrite_fails
            assert "injected" in str(e), e
        watch = OutsideWatch(outside)
        error, named, silent = None, False, False
        try:
            got = lib.load(path)
            silent = not _same(got)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - any error counts (DCP's CheckpointException is a BaseException)
            error = f"{type(e).__name__}: {' '.join(str(e).split())[:150]}"
            named = os.path.basename(lib.data(path)) in str(e) or path in str(e) or lib.index in str(e)
        outside_reads = len(watch.count())
        watch.close()
        lost = case == "overwrite_fails" and (error is not None or silent)
        rows[case] = {"error": error, "named": named, "silent": silent, "outside": outside_reads > 0, "lost": lost}
    return rows


def main():
    root = tempfile.mkdtemp(prefix="corruption-vs-dcp-")
    try:
        results = {lib.name: run(lib, root) for lib in (Shardwise(), DCP())}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'case':<22} | {'shardwise':<60} | torch DCP")
    for case in CASES:
        cells = []
        for name in results:
            r = results[name][case]
            if r["error"]:
                cell = f"error{' (names file)' if r['named'] else ''}: {r['error'][:40]}"
            else:
                cell = "SILENT: wrong values" if r["silent"] else "loaded, values right"
            cell += " [OUTSIDE READ]" if r["outside"] else ""
            cell += " [OLD CHECKPOINT LOST]" if r["lost"] else ""
            cells.append(cell)
        print(f"{case:<22} | {cells[0]:<60} | {cells[1]}")
    print()
    print("| | cases | errors | errors naming the file | silent | outside reads | data lost |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, rows in results.items():
        v = list(rows.values())
        print(f"| {name} | {len(v)} | {sum(bool(r['error']) for r in v)} | {sum(r['named'] for r in v)} | "
              f"{sum(r['silent'] for r in v)} | {sum(r['outside'] for r in v)} | {sum(r['lost'] for r in v)} |")


if __name__ == "__main__":
    main()
