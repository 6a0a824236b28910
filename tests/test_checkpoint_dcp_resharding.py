"""torch's DCP resharding cases (test/distributed/checkpoint/test_dtensor_resharding.py: 1-D <->
2-D meshes, every placement pair, empty and uneven shards, another world size) in DCP's own call
form, ``save(..., storage_writer=FileSystemWriter(path))`` / ``load(...,
storage_reader=FileSystemReader(path))``, run with torch's DCP and with shardwise: both must give
back the saved full tensors."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardwise.checkpoint as ck
from tests._dist import run_ranks

SHAPES = {"even": (8, 8), "uneven": (5, 7), "empty": (0, 4), "short": (3, 2)}  # 3 rows on 4 ranks: an empty shard
ONE = [Shard(0), Shard(1), Replicate()]


def _layouts(world: int) -> dict[str, tuple[tuple[int, ...], list]]:
    out = {f"1d-{p}": ((world,), [p]) for p in ONE}
    if world == 4:
        out.update({f"2d-{a}-{b}": ((2, 2), [a, b]) for a, b in itertools.product(ONE, ONE)})
    return out


def _value(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.arange(seed * 1000, seed * 1000 + shape[0] * shape[1], dtype=torch.float32).reshape(shape)


_MESHES: dict = {}  # one mesh per shape for a rank's life: every new group makes the next slower


def _mesh(shape: tuple[int, ...]):
    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape)
    return _MESHES[shape]


def _state(world: int, layouts: dict, fill: bool) -> dict:
    """One tensor per (saved layout, shape), each laid out as ``layouts[saved layout]``."""
    out = {}
    for src, (mesh_shape, placements) in layouts.items():
        mesh = _mesh(mesh_shape)
        for s, (name, shape) in enumerate(SHAPES.items()):
            full = _value(shape, s) if fill else torch.full(shape, -1.0)
            out[f"{src}/{name}"] = distribute_tensor(full, mesh, placements)
    return out


def _save(rank, world_size, root):
    dcp.save(_state(world_size, _layouts(world_size), True), storage_writer=dcp.FileSystemWriter(f"{root}/torch"))
    ck.save(_state(world_size, _layouts(world_size), True), storage_writer=ck.FileSystemWriter(f"{root}/ours"))
    return True


def _load_all(rank, world_size, root, saved_layouts):
    bad = []
    for dst, layout in _layouts(world_size).items():
        for impl in ("torch", "shardwise"):
            state = _state(world_size, {src: layout for src in saved_layouts}, False)
            if impl == "torch":
                dcp.load(state, storage_reader=dcp.FileSystemReader(f"{root}/torch"))
            else:
                ck.load(state, storage_reader=ck.FileSystemReader(f"{root}/ours"))
            for src in saved_layouts:
                for s, (name, shape) in enumerate(SHAPES.items()):
                    if not torch.equal(state[f"{src}/{name}"].full_tensor(), _value(shape, s)):
                        bad.append(f"{impl}: {src} -> {dst} {name}")
    return bad


def test_resharding_matches_torch_dcp(tmp_path):
    root = str(tmp_path)
    assert run_ranks(_save, 4, root, timeout=300) == [True] * 4
    for load_world in (4, 2):
        out = run_ranks(_load_all, load_world, root, list(_layouts(4)), timeout=300)
        assert out == [[]] * load_world, out[0][:10]


def test_filesystem_writer_and_reader_arguments(tmp_path):
    ck.FileSystemWriter(tmp_path, single_file_per_rank=True, sync_files=False, thread_count=4,
                        per_thread_copy_ahead=1, cache_staged_state_dict=True, overwrite=True,
                        serialization_format=dcp.filesystem.SerializationFormat.SAFETENSORS)
    for kw in ({"single_file_per_rank": False}, {"overwrite": False}, {"_extensions": [object()]}):
        with pytest.raises(ValueError, match=f"FileSystemWriter\\({next(iter(kw))}="):
            ck.FileSystemWriter(tmp_path, **kw)
    with pytest.raises(ValueError, match="_extension_registry"):
        ck.FileSystemReader(tmp_path, _extension_registry=object())
    path = str(tmp_path / "c")
    ck.save({"w": torch.ones(2)}, storage_writer=ck.FileSystemWriter(path), checkpoint_id=path)
    got = {"w": torch.zeros(2)}
    ck.load(got, storage_reader=ck.FileSystemReader(path))
    assert torch.equal(got["w"], torch.ones(2))
    with pytest.raises(TypeError, match="two paths"):
        ck.load(got, checkpoint_id=str(tmp_path / "other"), storage_reader=ck.FileSystemReader(path))
