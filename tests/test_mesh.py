"""Tests of `shardwise.mesh`: ParallelDims arithmetic, host fit, real meshes."""

from __future__ import annotations

import dataclasses
import math
import re
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardwise.mesh import (AXIS_NAMES, HostLayoutWarning, ParallelDims, data_parallel_mesh,
                            default_backend, default_device_type, host_fit_problem,
                            init_distributed, init_mesh)
from tests._dist import run_ranks

SIZES = st.integers(min_value=1, max_value=12)
# No per-example deadline: the machine is shared and has 2 cores.
NO_DEADLINE = settings(deadline=None)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --- ParallelDims ----------------------------------------------------------


@NO_DEADLINE
@given(dp_replicate=SIZES, dp_shard=SIZES, tp=SIZES, inferred=st.sampled_from([None, *AXIS_NAMES]))
def test_valid_sizes_resolve(dp_replicate: int, dp_shard: int, tp: int, inferred: str | None) -> None:
    sizes = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp}
    world_size = math.prod(sizes.values())
    given_sizes = {**sizes, **({inferred: -1} if inferred else {})}
    dims = ParallelDims(**given_sizes, world_size=world_size)
    assert dims.mesh_shape == (dp_replicate, dp_shard, tp)
    assert dims.dp_size == dp_replicate * dp_shard
    assert dims.axis_names == ("dp_replicate", "dp_shard", "tp")
    expected_dp = ("dp_shard",) if dp_replicate == 1 else ("dp_replicate", "dp_shard")
    assert dims.dp_axis_names == expected_dp
    with pytest.raises(dataclasses.FrozenInstanceError):
        dims.tp = 3  # type: ignore[misc]


def test_defaults_shard_over_the_world() -> None:
    assert ParallelDims(world_size=8).mesh_shape == (1, 8, 1)
    assert ParallelDims(dp_replicate=2, tp=2, world_size=8).mesh_shape == (2, 2, 2)


@NO_DEADLINE
@given(dp_replicate=SIZES, dp_shard=SIZES, tp=SIZES, world_size=st.integers(1, 2000))
def test_wrong_product_shows_arithmetic(dp_replicate: int, dp_shard: int, tp: int, world_size: int) -> None:
    product = dp_replicate * dp_shard * tp
    if product == world_size:
        world_size += 1
    expected = (f"dp_replicate({dp_replicate}) * dp_shard({dp_shard}) * tp({tp}) = "
                f"{product} != world_size({world_size})")
    with pytest.raises(ValueError, match=re.escape(expected)):
        ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, world_size=world_size)


@NO_DEADLINE
@given(inferred=st.sampled_from(AXIS_NAMES), a=SIZES, b=SIZES, world_size=st.integers(1, 2000))
def test_unresolvable_minus_one_shows_arithmetic(inferred: str, a: int, b: int, world_size: int) -> None:
    assume(world_size % (a * b) != 0)
    others = [name for name in AXIS_NAMES if name != inferred]
    sizes = dict(zip(others, (a, b)), **{inferred: -1})
    expected = (f"{inferred}=-1 cannot be resolved: world_size({world_size}) is not divisible "
                f"by {others[0]}({a}) * {others[1]}({b}) = {a * b}")
    with pytest.raises(ValueError, match=re.escape(expected)):
        ParallelDims(**sizes, world_size=world_size)


def test_brief_examples() -> None:
    with pytest.raises(ValueError, match=re.escape(
            "dp_replicate(2) * dp_shard(3) * tp(1) = 6 != world_size(8)")):
        ParallelDims(dp_replicate=2, dp_shard=3, world_size=8)
    with pytest.raises(ValueError, match=re.escape(
            "dp_shard=-1 cannot be resolved: world_size(8) is not divisible by "
            "dp_replicate(3) * tp(1) = 3")):
        ParallelDims(dp_replicate=3, world_size=8)


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        (dict(dp_shard=-1, tp=-1, world_size=4), ValueError, "dp_shard=-1 and tp=-1: at most one"),
        (dict(tp=0, world_size=4), ValueError, "tp=0 is invalid"),
        (dict(dp_replicate=-2, world_size=4), ValueError, "dp_replicate=-2 is invalid"),
        (dict(world_size=0), ValueError, "world_size=0 is invalid"),
        (dict(world_size=-1), ValueError, "world_size=-1 is invalid"),
        (dict(tp=2.0, world_size=4), TypeError, "tp must be an int, got 2.0"),
        (dict(tp=True, world_size=4), TypeError, "tp must be an int, got True"),
        (dict(world_size="4"), TypeError, "world_size must be an int"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, error: type, text: str) -> None:
    with pytest.raises(error, match=re.escape(text)):
        ParallelDims(**kwargs)


def test_world_size_is_required_and_keyword_only() -> None:
    with pytest.raises(TypeError):
        ParallelDims()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        ParallelDims(1, 4, 1, 4)  # type: ignore[misc]


# --- host fit ---------------------------------------------------------------


@st.composite
def _multi_host(draw):
    local = draw(st.integers(1, 8))
    hosts = draw(st.integers(2, 4))
    world = local * hosts
    tp = draw(st.sampled_from(_divisors(world)))
    dp_shard = draw(st.sampled_from(_divisors(world // tp)))
    dims = ParallelDims(dp_shard=dp_shard, tp=tp, dp_replicate=-1, world_size=world)
    return dims, local


@NO_DEADLINE
@given(_multi_host())
def test_host_fit_matches_block_rule(case) -> None:
    dims, local = case
    problem = host_fit_problem(dims, local)
    block = dims.dp_shard * dims.tp
    assert (problem is None) == (local % block == 0)
    if problem is None:
        return
    assert f"dp_shard({dims.dp_shard}) * tp({dims.tp}) = {block}" in problem
    assert f"local_world_size({local})" in problem
    suggested = re.search(r"dp_replicate=(\d+), dp_shard=(\d+), tp=(\d+)", problem)
    if local % dims.tp == 0:
        assert suggested, problem
        rep, shard, tp = map(int, suggested.groups())
        better = ParallelDims(dp_replicate=rep, dp_shard=shard, tp=tp, world_size=dims.world_size)
        assert better.tp == dims.tp
        assert host_fit_problem(better, local) is None
    else:
        assert f"tp({dims.tp}) does not divide local_world_size({local})" in problem


@NO_DEADLINE
@given(dims=st.builds(lambda s, t: ParallelDims(dp_shard=s, tp=t, world_size=s * t), SIZES, SIZES),
       extra=st.integers(0, 8))
def test_single_host_or_unknown_is_fine(dims: ParallelDims, extra: int) -> None:
    assert host_fit_problem(dims, None) is None
    assert host_fit_problem(dims, dims.world_size + extra) is None


def test_host_fit_examples_and_bad_local() -> None:
    problem = host_fit_problem(ParallelDims(world_size=16), 8)
    assert "Consider dp_replicate=2, dp_shard=8, tp=1" in problem
    assert host_fit_problem(ParallelDims(dp_replicate=2, world_size=16), 8) is None
    assert host_fit_problem(ParallelDims(world_size=12), 8) is None  # uneven hosts: unknown
    for bad in (0, -8, 2.5, True):
        with pytest.raises(ValueError, match="local_world_size"):
            host_fit_problem(ParallelDims(world_size=16), bad)


# --- devices, errors without a process group --------------------------------


def test_defaults_for_device_and_backend() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert default_device_type() == expected
    assert default_backend("cuda") == "nccl"
    assert default_backend("cpu") == "gloo"
    assert default_backend() == default_backend(expected)
    with pytest.raises(ValueError, match="pass backend= explicitly"):
        default_backend("xpu")


def test_init_mesh_without_process_group_says_how_to_launch() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torchrun.*init_process_group.*init_distributed"):
        init_mesh()


def test_init_distributed_partial_env_names_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT unset.*torchrun"):
        init_distributed()
    assert not dist.is_initialized()


# --- real meshes on gloo ranks ----------------------------------------------


def _mesh_body(rank: int, world_size: int, shape: tuple[int, int, int]) -> dict:
    dp_replicate, dp_shard, tp = shape
    mesh = init_mesh(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, device_type="cpu")
    dp_mesh = data_parallel_mesh(mesh)
    groups = {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in AXIS_NAMES}
    sums = {}
    for name in AXIS_NAMES:  # the groups really communicate
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mesh.get_group(name))
        sums[name] = t.item()
    try:
        data_parallel_mesh(mesh["dp_shard", "tp"])
        missing_error = None
    except ValueError as exc:
        missing_error = str(exc)
    return dict(names=mesh.mesh_dim_names, shape=tuple(mesh.shape), layout=mesh.mesh.tolist(),
                device_type=mesh.device_type, groups=groups, sums=sums, dp_ndim=dp_mesh.ndim,
                dp_names=dp_mesh.mesh_dim_names, dp_ranks=dp_mesh.mesh.tolist(),
                missing_error=missing_error)


def _expected_group(grid: torch.Tensor, rank: int, axis: int) -> list[int]:
    index = list((grid == rank).nonzero()[0].tolist())
    index[axis] = slice(None)
    return grid[tuple(index)].flatten().tolist()


@pytest.mark.parametrize("shape", [(1, 4, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2)])
def test_init_mesh_layout_and_groups(shape: tuple[int, int, int]) -> None:
    out = run_ranks(_mesh_body, 4, shape, timeout=30.0)
    grid = torch.arange(4).reshape(shape)
    for rank, got in enumerate(out):
        assert got["names"] == AXIS_NAMES
        assert got["shape"] == shape
        assert got["device_type"] == "cpu"
        assert got["layout"] == grid.tolist()
        for axis, name in enumerate(AXIS_NAMES):
            expected = _expected_group(grid, rank, axis)
            assert got["groups"][name] == expected, (rank, name)
            assert got["sums"][name] == sum(expected), (rank, name)
        tp_index = rank % shape[2]
        if shape[0] == 1:
            assert (got["dp_ndim"], got["dp_names"]) == (1, ("dp_shard",))
            assert got["dp_ranks"] == grid[0, :, tp_index].tolist()
        else:
            assert (got["dp_ndim"], got["dp_names"]) == (2, ("dp_replicate", "dp_shard"))
            assert got["dp_ranks"] == grid[:, :, tp_index].tolist()
        assert "lacks ['dp_replicate']" in got["missing_error"]


def _wrong_shape_body(rank: int, world_size: int, kwargs: dict) -> str:
    with pytest.raises(ValueError) as info:
        init_mesh(**kwargs, device_type="cpu")
    return str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        (dict(dp_replicate=3, dp_shard=1), "dp_replicate(3) * dp_shard(1) * tp(1) = 3 != world_size(4)"),
        (dict(dp_replicate=3), "dp_shard=-1 cannot be resolved: world_size(4) is not divisible by "
                               "dp_replicate(3) * tp(1) = 3"),
        (dict(world_size=8), "init_mesh(world_size=8) but the default process group has 4 ranks"),
    ],
)
def test_wrong_shape_raises_on_every_rank(kwargs: dict, text: str) -> None:
    messages = run_ranks(_wrong_shape_body, 4, kwargs, timeout=30.0)
    assert all(text in message for message in messages), messages


def _warnings_body(rank: int, world_size: int, shape: tuple[int, int, int]) -> list[str]:
    dp_replicate, dp_shard, tp = shape
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        init_mesh(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, device_type="cpu")
    return [str(w.message) for w in caught if issubclass(w.category, HostLayoutWarning)]


def test_host_warning_on_rank_zero_when_block_spans_hosts() -> None:
    two_hosts = {"LOCAL_WORLD_SIZE": 2}
    out = run_ranks(_warnings_body, 4, (1, 4, 1), env=two_hosts, timeout=30.0)
    assert len(out[0]) == 1 and out[1:] == [[], [], []], out
    assert "Consider dp_replicate=2, dp_shard=2, tp=1" in out[0][0]
    assert run_ranks(_warnings_body, 4, (2, 2, 1), env=two_hosts, timeout=30.0) == [[]] * 4
    assert run_ranks(_warnings_body, 4, (1, 4, 1), timeout=30.0) == [[]] * 4  # one host


def _init_distributed_body(rank: int, world_size: int) -> dict:
    first = init_distributed()
    again = init_distributed()
    mesh = init_mesh(tp=2 if world_size % 2 == 0 else 1, device_type="cpu")
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"first": first, "again": again, "backend": dist.get_backend(),
            "shape": tuple(mesh.shape), "sum": t.item()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU/gloo defaults")


@CPU_ONLY
def test_init_distributed_from_torchrun_env() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": _free_port()}
    out = run_ranks(_init_distributed_body, 2, init_group=False, env=env, timeout=30.0)
    for rank, got in enumerate(out):
        assert got == {"first": (rank, 2), "again": (rank, 2), "backend": "gloo",
                       "shape": (1, 1, 2), "sum": 2.0}


@CPU_ONLY
def test_init_distributed_without_launcher_is_one_rank() -> None:
    unset = dict.fromkeys(("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    (got,) = run_ranks(_init_distributed_body, 1, init_group=False, env=unset, timeout=30.0)
    assert got == {"first": (0, 1), "again": (0, 1), "backend": "gloo",
                   "shape": (1, 1, 1), "sum": 1.0}
