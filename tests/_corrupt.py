"""Damaged copies of a small shardwise checkpoint, and a watch for reads outside it.

Each case of `CASES` takes a fresh copy of a good checkpoint (``path``) and a folder outside
it (``outside``, holding ``outside.safetensors``, a valid safetensors file, and ``passwd``, a
text file) and damages the copy the way its name says. ``hostile`` edits recompute the
index's own checksum (an attacker or a buggy tool can), so the check under test is the one
meant, not the checksum; ``random`` ones do not. `OutsideWatch` counts every open or read of
a file in the outside folder by any process (inotify), so also reads done by Rust code
(safetensors) or by other ranks.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct

from shardwise.checkpoint._format import CHECKSUM_FIELD, index_checksum

_IN_ACCESS, _IN_OPEN = 0x1, 0x20


class OutsideWatch:
    """Counts opens and reads of files in ``folder`` (Linux inotify) until `count` is called."""

    def __init__(self, folder: str) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or self._libc.inotify_add_watch(self.fd, folder.encode(), _IN_ACCESS | _IN_OPEN) < 0:
            raise OSError(ctypes.get_errno(), "inotify")

    def count(self) -> list[str]:
        """The file names opened or read since the last call."""
        names = []
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return names
            pos = 0
            while pos < len(data):
                _, mask, _, n = struct.unpack_from("iIII", data, pos)
                name = data[pos + 16: pos + 16 + n].rstrip(b"\0").decode()
                if name:
                    names.append(name)
                pos += 16 + n

    def close(self) -> None:
        os.close(self.fd)


def _index(path: str) -> dict:
    with open(os.path.join(path, "index.json")) as f:
        return json.load(f)


def _write_index(path: str, index: dict, rehash: bool) -> None:
    if rehash:
        index[CHECKSUM_FIELD] = index_checksum(index)
    with open(os.path.join(path, "index.json"), "w") as f:
        json.dump(index, f)


def edit(path: str, fn, rehash: bool) -> None:
    index = _index(path)
    fn(index)
    _write_index(path, index, rehash)


def _w(index: dict) -> dict:
    return index["tensors"]["w"]


def _data(path: str, rank: int = 1) -> str:
    return os.path.join(path, f"rank-{rank:05d}.safetensors")


def _flip_data(path: str) -> None:
    with open(_data(path), "r+b") as f:
        f.seek(-5, os.SEEK_END)
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x10]))


def _same_size_header(path: str, header: object) -> None:
    """Replace the data file's header by ``header`` (JSON), keeping the file's size."""
    file = _data(path)
    size = os.path.getsize(file)
    raw = json.dumps(header).encode()
    body = struct.pack("<Q", len(raw)) + raw
    with open(file, "wb") as f:
        f.write(body + b"\0" * max(0, size - len(body)))


def _overlap(index: dict) -> None:
    # w is [8, 3]: rank 0 rows 0..3, rank 1 rows 4..7. Make both claim 4 rows starting at 0 and 2:
    # the counts add up to 8 rows, rows 6..7 are a hole, rows 2..3 overlap.
    _w(index)["boxes"][1]["offsets"] = [2, 0]


def _symlink(path: str, outside: str, name: str) -> None:
    os.remove(_data(path))
    os.symlink(os.path.join(outside, name), _data(path))


def _passwd(path: str, outside: str) -> None:
    size = os.path.getsize(_data(path))
    text = (b"root:x:0:0:root:/root:/bin/bash\n" * (size // 32 + 1))[:size]
    with open(_data(path), "wb") as f:
        f.write(text)


def _point_at(index: dict, name: str) -> None:
    box = _w(index)["boxes"][1]
    index["files"][name] = index["files"].pop(box["file"])
    for t in index["tensors"].values():
        for b in t["boxes"]:
            if b["file"] == box["file"]:
                b["file"] = name


def _old_index_crc_null(path: str) -> None:
    def fn(index):
        index.pop(CHECKSUM_FIELD, None)
        for b in _w(index)["boxes"]:
            b["crc32"] = None
            b.pop("chunk_rows", None)
            b.pop("chunk_crc32", None)
    edit(path, fn, rehash=False)
    _flip_data(path)


def _duplicate_key(path: str) -> None:
    file = os.path.join(path, "index.json")
    text = open(file).read()
    line = next(ln for ln in text.splitlines() if ln.strip().startswith('"w":'))
    changed = line.replace('"offsets": [4, 0]', '"offsets": [0, 0]')
    open(file, "w").write(text.replace(line, line.rstrip(",") + ",\n" + changed))


# name -> (damage(path, outside), data_only): data_only cases change only data bytes, which
# `inspect` (index, file sizes and headers only) cannot see by design.
CASES = {
    "nonexistent": (lambda p, o: __import__("shutil").rmtree(p), False),
    "no_index": (lambda p, o: os.remove(os.path.join(p, "index.json")), False),
    "empty_dir": (lambda p, o: [os.remove(os.path.join(p, n)) for n in os.listdir(p)], False),
    "index_not_json": (lambda p, o: open(os.path.join(p, "index.json"), "w").write('{"format": "shardw'), False),
    "index_is_list": (lambda p, o: open(os.path.join(p, "index.json"), "w").write("[1, 2]"), False),
    "index_symlink_outside": (lambda p, o: (os.replace(os.path.join(p, "index.json"), os.path.join(o, "index.json")),
                                            os.symlink(os.path.join(o, "index.json"), os.path.join(p, "index.json"))),
                              False),
    "bad_version": (lambda p, o: edit(p, lambda i: i.update(version=99), rehash=True), False),
    "files_as_list": (lambda p, o: edit(p, lambda i: i.update(files=list(i["files"])), rehash=True), False),
    "tensors_as_list": (lambda p, o: edit(p, lambda i: i.update(tensors=list(i["tensors"])), rehash=True), False),
    "duplicate_tensor_key": (lambda p, o: _duplicate_key(p), False),
    "absolute_file_name": (lambda p, o: edit(p, lambda i: _point_at(i, os.path.join(o, "outside.safetensors")),
                                             rehash=True), False),
    "dotdot_file_name": (lambda p, o: edit(p, lambda i: _point_at(i, f"../{os.path.basename(o)}/outside.safetensors"),
                                           rehash=True), False),
    "symlink_data_file": (lambda p, o: _symlink(p, o, "outside.safetensors"), False),
    "system_text_file_as_data": (lambda p, o: _passwd(p, o), False),
    "data_file_is_dir": (lambda p, o: (os.remove(_data(p)), os.mkdir(_data(p))), False),
    "overlap_same_count": (lambda p, o: edit(p, _overlap, rehash=True), False),
    "hole": (lambda p, o: edit(p, lambda i: _w(i)["boxes"].pop(), rehash=True), False),
    "box_number_flip": (lambda p, o: edit(p, lambda i: _w(i)["boxes"][1].update(offsets=[3, 0]), rehash=False), False),
    "plain_value_changed": (lambda p, o: edit(p, lambda i: i["values"].update(step=4), rehash=False), False),
    "crc_null_plus_flip_old_index": (lambda p, o: _old_index_crc_null(p), False),
    "crc_null_checksummed_index": (lambda p, o: edit(p, lambda i: [b.update(crc32=None) for b in _w(i)["boxes"]],
                                                     rehash=False), False),
    "shape_2_pow_62": (lambda p, o: edit(p, lambda i: _w(i).update(shape=[2 ** 62, 3]), rehash=True), False),
    "box_2_pow_62": (lambda p, o: edit(p, lambda i: (_w(i).update(shape=[2 ** 62, 3]),
                                                     _w(i)["boxes"][1].update(sizes=[2 ** 62 - 4, 3])), rehash=True),
                     False),
    "wrong_dtype_in_index": (lambda p, o: edit(p, lambda i: _w(i).update(dtype="float64"), rehash=True), False),
    "header_is_list": (lambda p, o: _same_size_header(p, [1, 2, 3]), False),
    "header_without_data_offsets": (lambda p, o: _same_size_header(p, {"w@4,0": {"dtype": "F32", "shape": [4, 3]}}),
                                    False),
    "missing_data_file": (lambda p, o: os.remove(_data(p)), False),
    "truncated_data_file": (lambda p, o: os.truncate(_data(p), os.path.getsize(_data(p)) - 8), False),
    "data_byte_flip": (lambda p, o: _flip_data(p), True),
    "chunk_crc_malformed": (lambda p, o: edit(p, lambda i: _w(i)["boxes"][0].update(chunk_rows=2,
                                                                                   chunk_crc32="zz"), rehash=True),
                            False),
}
