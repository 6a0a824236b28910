"""What shardwise.checkpoint relies on in torch's private API, one test per fact.

``checkpoint/_base/_compat.py`` is the only library module that names a torch private API (the last
test enforces it). If a torch release changes one of these facts, the test stating it fails
here, naming the fact, instead of a checkpoint being saved with wrong boxes.

Facts:
1. ``torch.distributed.tensor.placement_types._StridedShard`` exists, is a ``Placement``, and
   ``_StridedShard(dim, split_factor=k)`` has ``.dim == dim`` and ``.split_factor == k``
   (`is_strided_shard`, `strided_split_factor`).
2. A DTensor's local shard for ``_StridedShard`` (and for ``Shard``, mixed on a 2-D mesh)
   holds exactly the rows that shardwise's own arithmetic (`strided_positions`,
   `chunk_span`) says, on real gloo ranks.
"""

from __future__ import annotations

import ast
import pathlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

import shardwise.checkpoint
from shardwise.checkpoint._base import _compat
from shardwise.checkpoint._geometry._boxes import boxes_for, chunk_span, local_boxes, strided_positions
from tests._dist import run_ranks

ROOT = pathlib.Path(shardwise.checkpoint.__file__).parent


# -- fact 1: the type and its attributes ----------------------------------------------------------

def test_strided_shard_is_importable_and_a_placement():
    from torch.distributed.tensor.placement_types import _StridedShard

    assert _compat.StridedShard is _StridedShard
    assert issubclass(_StridedShard, Placement), "_StridedShard is no longer a Placement"


@given(st.integers(0, 3), st.integers(1, 8))
@settings(max_examples=30, deadline=None)
def test_strided_shard_has_dim_and_split_factor(dim, k):
    p = _compat.StridedShard(dim, split_factor=k)
    assert p.dim == dim, f"_StridedShard(dim={dim}).dim is {p.dim}"
    assert _compat.strided_split_factor(p) == k and isinstance(_compat.strided_split_factor(p), int)
    assert _compat.is_strided_shard(p)
    assert not _compat.is_strided_shard(Shard(dim)) and not _compat.is_strided_shard(Replicate())


# -- fact 2: the local shard a DTensor holds -------------------------------------------------------

# (global shape, mesh shape, placements): the layouts FSDP over TP produces, uneven sizes included
CASES = [
    ((11, 3), (2, 2), ("SS0:2", "S0")),  # FSDP (dim 0) over TP Shard(0): rows of 2 TP pieces
    ((13, 2), (4,), ("SS0:2",)),  # uneven: some pieces empty on some ranks
    ((5, 7), (2, 2), ("S0", "SS1:3")),
    ((3, 9), (2, 2), ("SS1:2", "S1")),
    ((7, 4), (4,), ("SS0:3",)),
    ((6, 5), (2, 2), ("S1", "S0")),  # plain Shard on both axes (no strided)
]


def _placements(spec):
    out = []
    for s in spec:
        if s.startswith("SS"):
            dim, k = s[2:].split(":")
            out.append(_compat.StridedShard(int(dim), split_factor=int(k)))
        else:
            out.append(Shard(int(s[1:])) if s.startswith("S") else Replicate())
    return out


def _expected_local(full: torch.Tensor, mesh_shape, coord, placements) -> torch.Tensor:
    """The local tensor at ``coord`` by shardwise's arithmetic alone (index lists per dim)."""
    held = [list(range(n)) for n in full.shape]
    for axis, p in enumerate(placements):
        if _compat.is_strided_shard(p):
            pos = strided_positions(len(held[p.dim]), _compat.strided_split_factor(p), mesh_shape[axis], coord[axis])
            held[p.dim] = [held[p.dim][i] for i in pos]
        elif isinstance(p, Shard):
            start, size = chunk_span(len(held[p.dim]), mesh_shape[axis], coord[axis])
            held[p.dim] = held[p.dim][start : start + size]
    out = full
    for d, idx in enumerate(held):
        out = out.index_select(d, torch.tensor(idx, dtype=torch.long))
    return out


def _local_shards_match(rank, world_size, cases):
    bad, meshes = [], {}
    for shape, mesh_shape, spec in cases:
        if mesh_shape not in meshes:
            meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape)
        mesh = meshes[mesh_shape]
        placements = _placements(spec)
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        dt = distribute_tensor(full, mesh, placements, src_data_rank=None)  # each rank splits locally
        coord = mesh.get_coordinate()
        want = _expected_local(full, mesh_shape, coord, placements)
        got = dt.to_local()
        if got.shape != want.shape or not torch.equal(got, want):
            bad.append(f"{shape} {spec} at {coord}: DTensor holds {got.tolist()}, shardwise expects {want.tolist()}")
            continue
        # and the boxes the checkpoint saves for this rank hold exactly those elements, in place
        filled = torch.full_like(got, -1.0)
        for lb in local_boxes(dt):
            filled[lb.local_region().slices()] = full[lb.box.slices()]
        if not torch.equal(filled, got):
            bad.append(f"{shape} {spec} at {coord}: local_boxes do not rebuild the local shard")
        if boxes_for(shape, mesh_shape, coord, placements) != local_boxes(dt):
            bad.append(f"{shape} {spec} at {coord}: boxes_for and local_boxes differ")
    return bad


def test_dtensor_local_shards_equal_shardwise_arithmetic():
    for bad in run_ranks(_local_shards_match, 4, CASES, timeout=120):
        assert not bad, "torch's _StridedShard/Shard layout changed:\n" + "\n".join(bad)


# -- the fence: no other library module names a torch private API ----------------------------------

KNOWN_PRIVATE_ATTRS = {"_cdata", "_local_tensor", "_spec", "_get_root_mesh", "_execution_engine", "_foreach_norm",
                       "_local_shard_size_and_offset", "_split_tensor"}


def private_torch_uses(source: str) -> list[str]:
    """The torch private names ``source`` uses: imports from a private torch module or of a
    private name, attributes with a leading underscore reached from a name bound to torch,
    and attributes known to be torch's private ones on any object."""
    tree = ast.parse(source)
    torch_names: set[str] = set()
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    torch_names.add(a.asname or "torch")
                    if any(part.startswith("_") for part in a.name.split(".")):
                        found.append(f"line {node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"line {node.lineno}: from {node.module} import ...")
            for a in node.names:
                torch_names.add(a.asname or a.name)
                if a.name.startswith("_"):
                    found.append(f"line {node.lineno}: from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if node.attr in KNOWN_PRIVATE_ATTRS or (isinstance(root, ast.Name) and root.id in torch_names):
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_the_fence_finds_private_uses():
    src = ("import torch\nimport torch.distributed as dist\nfrom torch.distributed.tensor._utils import f\n"
           "from torch.distributed.tensor.placement_types import _StridedShard\n"
           "x = torch._foreach_norm\ny = dist._something\nz = t.untyped_storage()._cdata\nself._mine = 1\n")
    found = private_torch_uses(src)
    assert len(found) == 5, found
    assert private_torch_uses("import torch\nx = torch.chunk\nself._x = 1\n") == []


def test_no_checkpoint_module_but_compat_names_a_torch_private_api():
    fence = ROOT / "_base" / "_compat.py"
    offenders = {str(p.relative_to(ROOT)): private_torch_uses(p.read_text()) for p in sorted(ROOT.rglob("*.py"))
                 if p != fence}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"torch private APIs outside checkpoint/_base/_compat.py: {offenders}"
    assert private_torch_uses(fence.read_text()), "the fence test no longer sees _compat's import"
