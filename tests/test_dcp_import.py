"""``import_dcp`` / ``import-dcp``: checkpoints written by torch's own DCP, converted, loaded.

Each DCP checkpoint is written in the test by ``torch.distributed.checkpoint`` itself (torch's
``fully_shard`` on 4 gloo ranks, HSDP on a 2 x 2 mesh, torch's tensor parallelism on 2 ranks,
FSDP on top of TP on a 2 x 2 mesh, and one plain process), with torch's ``get_model_state_dict`` / ``get_optimizer_state_dict``
after two AdamW steps; the saving job also keeps the full tensors (``full_tensor()``). The
converted checkpoint is loaded with ``shardwise.checkpoint.load`` into shardwise's
``fully_shard`` at another world size and into one plain process, and every tensor, model and
optimizer, is compared with ``torch.equal`` against those full tensors; ``param_groups`` must
come back equal too. Hostile and damaged sources are refused with one line, and a malicious
``.metadata`` runs no code.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardwise.checkpoint import (CheckpointError, get_model_state_dict, get_optimizer_state_dict, import_dcp, load,
                                  main, verify_checkpoint)
from shardwise.composable import fully_shard
from tests._dist import run_ranks
from tests._models import Block, Net, batches, loss_fn, make_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _flat(tree, prefix=""):
    """``{"model/emb.weight": full tensor, ..., "optim/param_groups": [...]}`` of a torch state
    dict, written here independently of the library (keys joined with "/")."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "/"))
        elif isinstance(v, torch.Tensor):
            out[key] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        else:
            out[key] = v
    return out


def _train(model, opt, steps: int = 2) -> None:
    for tokens, target in batches(steps, 4):
        loss_fn(model(tokens), target).backward()
        opt.step()
        opt.zero_grad()


def _net(layout: str) -> nn.Module:
    """A Net; for tensor parallelism with hidden size 8 (torch's TP needs the sharded dims even)."""
    model = Net()
    if layout in ("tp", "fsdp_tp"):
        model.blocks = nn.ModuleList(Block(6, hidden=8) for _ in range(2))
    return model


def _dcp_save(rank: int, world: int, layout: str, path: str, ref_path: str) -> None:
    """Train a Net 2 steps under torch's own layout ``layout`` and save it with torch DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict as dcp_msd
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict as dcp_osd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import parallel as tp

    torch.manual_seed(0)
    model = _net(layout)
    if layout in ("tp", "fsdp_tp"):
        mesh = init_device_mesh("cpu", (world // 2, 2) if layout == "fsdp_tp" else (1, world),
                                mesh_dim_names=("dp", "tp"))
        plan = {f"blocks.{i}.{n}": s for i in range(2) for n, s in (("up", tp.ColwiseParallel()),
                                                                     ("down", tp.RowwiseParallel()))}
        tp.parallelize_module(model, mesh["tp"], plan)
        if layout == "fsdp_tp":  # torch's 2-D: FSDP over "dp" on top of TP (strided shards)
            for b in model.blocks:
                torch_fully_shard(b, mesh=mesh["dp"])
            torch_fully_shard(model, mesh=mesh["dp"])
    else:
        mesh = (init_device_mesh("cpu", (world,)) if layout == "fsdp"
                else init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard")))
        for b in model.blocks:
            torch_fully_shard(b, mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, opt)
    state = {"model": dcp_msd(model), "optim": dcp_osd(model, opt), "trainer": {"step": 2, "name": "net"}}
    dcp.save(state, checkpoint_id=path)
    full = _flat(state)
    if rank == 0:
        torch.save(full, ref_path)


def _mismatches(state: dict, ref: dict) -> list[str]:
    got = _flat(state)
    bad = [k for k in ref if k not in got]
    for k, v in got.items():
        want = ref.get(k)
        if isinstance(v, torch.Tensor):
            if not (isinstance(want, torch.Tensor) and want.dtype == v.dtype and torch.equal(want, v)):
                bad.append(k)
        elif v != want and not (k == "optim/param_groups" and _groups_equal(v, want)):
            bad.append(k)
    return bad


def _groups_equal(a, b) -> bool:
    """param_groups equal up to tuples stored as lists (JSON)."""
    norm = lambda g: {k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}  # noqa: E731
    return [norm(g) for g in a] == [norm(g) for g in b]


def _sw_state(world: int | None, layout: str, seed: int = 1) -> dict:
    torch.manual_seed(seed)  # another init than the saved one: every value must come from the file
    model = _net(layout)
    if world is not None:
        mesh = make_mesh((world,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
            "trainer": {"step": 0, "name": ""}}


def _sw_load(rank: int, world: int, path: str, ref_path: str, layout: str) -> list[str]:
    state = _sw_state(world, layout)
    load(state, path)
    return _mismatches(state, torch.load(ref_path, weights_only=True))


@pytest.mark.parametrize("layout, save_world, load_world", [("fsdp", 4, 2), ("hsdp", 4, 2), ("tp", 2, 4),
                                                                 ("fsdp_tp", 4, 2)])
def test_torch_dcp_checkpoint_imports_and_loads_at_another_world_size(tmp_path, layout, save_world, load_world):
    src, dst, ref = str(tmp_path / "dcp"), str(tmp_path / "sw"), str(tmp_path / "ref.pt")
    run_ranks(_dcp_save, save_world, layout, src, ref, timeout=90)
    assert any(n.endswith(".distcp") for n in os.listdir(src)) and ".metadata" in os.listdir(src)
    stats = import_dcp(src, dst)
    assert stats.source_world_size == save_world and stats.files >= 2, stats
    assert verify_checkpoint(dst).fully_checked
    results = run_ranks(_sw_load, load_world, dst, ref, layout, timeout=90)
    assert results == [[]] * load_world, results
    plain = _sw_state(None, layout)
    load(plain, dst)
    assert _mismatches(plain, torch.load(ref, weights_only=True)) == []
    assert plain["optim"]["param_groups"][0]["lr"] == 1e-2 and plain["trainer"] == {"step": 2, "name": "net"}


def _plain_dcp(path: str) -> dict:
    """A one-process DCP checkpoint with dtypes of both record kinds (v2 and v3), a 0-d tensor, a
    non-contiguous tensor and a 1 MiB one; returns the full tensors."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    extra = {"bf16": torch.randn(5, dtype=torch.bfloat16), "u16": torch.arange(6).to(torch.uint16).view(2, 3),
             "i64": torch.tensor(7), "t": torch.randn(4, 3).t(), "big": torch.randn(512, 512),
             "tuple": (torch.ones(2), 3)}
    state = {"model": msd, "optim": osd, "extra": extra}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is disabled ... single process"
        dcp.save(state, checkpoint_id=path, no_dist=True)
    return state


def test_plain_dcp_checkpoint_every_dtype_and_record_kind_bit_exact(tmp_path):
    src, dst = str(tmp_path / "dcp"), str(tmp_path / "sw")
    saved = _plain_dcp(src)
    stats = import_dcp(src, dst)
    assert stats.tensors == 4 + 4 * 3 + 6 and stats.values == 2, stats  # the tuple: a tensor and a value
    target = {"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()},
              "optim": {"state": {p: {k: torch.zeros_like(v) for k, v in s.items()}
                                  for p, s in saved["optim"]["state"].items()}, "param_groups": []},
              "extra": {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else [torch.zeros(2), 0])
                        for k, v in saved["extra"].items()}}
    load(target, dst)
    ref = _flat(saved)
    ref["extra/tuple"], got = None, _flat(target)
    assert [k for k, v in got.items() if isinstance(v, torch.Tensor) and not torch.equal(v, ref[k])] == []
    assert torch.equal(target["extra"]["tuple"][0], torch.ones(2)) and target["extra"]["tuple"][1] == 3
    assert target["optim"]["param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert target["optim"]["param_groups"][0]["betas"] == [0.9, 0.999]


def test_memory_is_one_slab_not_the_model(tmp_path):
    """The largest buffer the converter allocates is one slab of ``chunk_bytes`` (rows of the
    1 MiB tensor), and never more than the largest chunk."""
    src = str(tmp_path / "dcp")
    _plain_dcp(src)
    small = import_dcp(src, str(tmp_path / "a"), chunk_bytes=64 << 10)
    assert small.bytes_copied > 1 << 20 and small.largest_buffer_bytes <= 64 << 10, small
    default = import_dcp(src, str(tmp_path / "b"))
    assert default.largest_buffer_bytes == 512 * 512 * 4 < default.bytes_copied, default


def test_command_line_and_module_entry_point_without_torch_dcp(tmp_path):
    src = str(tmp_path / "dcp")
    _plain_dcp(src)
    assert main(["import-dcp", src, str(tmp_path / "a")]) == 0
    code = ("import sys, runpy; sys.argv = ['x', 'import-dcp', sys.argv[1], sys.argv[2]]\n"
            "try:\n    runpy.run_module('shardwise.checkpoint', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "assert 'torch.distributed.checkpoint' not in sys.modules, 'the library imported torch DCP'\n")
    out = subprocess.run([sys.executable, "-c", code, src, str(tmp_path / "b")], capture_output=True, text=True,
                         timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0 and "imported the DCP checkpoint" in out.stdout, out.stderr
    assert verify_checkpoint(str(tmp_path / "b")).fully_checked


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_malicious_metadata_runs_no_code(tmp_path, capsys):
    marker = tmp_path / "pwned"
    src = tmp_path / "dcp"
    _plain_dcp(str(src))
    (src / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    with pytest.raises(CheckpointError, match=r"refusing to unpickle posix\.system"):
        import_dcp(str(src), str(tmp_path / "out"))
    err = _one_line_error(capsys, ["import-dcp", str(src), str(tmp_path / "out")])
    assert "posix.system" in err and not marker.exists() and not (tmp_path / "out").exists()
    # the same object inside a non-tensor entry's torch.save record in a .distcp file
    src2 = tmp_path / "dcp2"
    _plain_dcp(str(src2))
    import io
    buf = io.BytesIO()
    torch.save(_Evil(str(marker)), buf)
    evil = buf.getvalue()
    with open(src2 / "__0_0.distcp", "ab") as f:
        start = f.tell()
        f.write(evil)
    md = pickle.loads((src2 / ".metadata").read_bytes())  # the test's own file; torch reads it here
    key = next(k for k in md.storage_data if k.fqn == "extra.tuple")
    md.storage_data[key].offset, md.storage_data[key].length = start, len(evil)
    (src2 / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"entry .extra\.tuple.: refusing to unpickle posix\.system"):
        import_dcp(str(src2), str(tmp_path / "out"))
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_bad_sources_and_targets_get_one_line_errors(tmp_path, capsys):
    src = tmp_path / "dcp"
    _plain_dcp(str(src))
    out = str(tmp_path / "out")
    # not a DCP directory
    (tmp_path / "empty").mkdir()
    assert "not a torch DCP checkpoint: it has no .metadata" in _one_line_error(capsys, ["import-dcp", str(tmp_path / "empty"), out])
    assert "does not exist" in _one_line_error(capsys, ["import-dcp", str(tmp_path / "nope"), out])
    # DST exists
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    assert "already exists" in _one_line_error(capsys, ["import-dcp", str(src), str(tmp_path / "taken")])
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    # a shardwise checkpoint as the source
    assert main(["import-dcp", str(src), out]) == 0
    capsys.readouterr()
    assert "already a shardwise checkpoint" in _one_line_error(capsys, ["import-dcp", out, str(tmp_path / "o2")])
    # a truncated .distcp file
    data = (src / "__0_0.distcp").read_bytes()
    (src / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    assert "__0_0.distcp is truncated" in _one_line_error(capsys, ["import-dcp", str(src), str(tmp_path / "o3")])
    # a missing one
    (src / "__0_0.distcp").unlink()
    assert "__0_0.distcp is missing" in _one_line_error(capsys, ["import-dcp", str(src), str(tmp_path / "o4")])
    # a flipped byte inside a tensor's data: caught against torch.save's own CRC-32, nothing written
    bad = bytearray(data)
    md = pickle.loads((src / ".metadata").read_bytes())
    info = next(v for k, v in md.storage_data.items() if k.fqn == "extra.big")
    bad[info.offset + info.length - 4096] ^= 0xFF
    (src / "__0_0.distcp").write_bytes(bytes(bad))
    assert "checksum mismatch" in _one_line_error(capsys, ["import-dcp", str(src), str(tmp_path / "o5")])
    assert not (tmp_path / "o5").exists() and not [n for n in os.listdir(tmp_path) if "incomplete" in n]


@pytest.mark.parametrize("data, message", [
    (b"\x80\x02cbuiltins\neval\nX\x04\x00\x00\x001+1q\x00\x85R.", r"refusing to unpickle builtins\.eval"),
    # BUILD on an allowlisted function (would set its attributes for the rest of the process)
    (b"\x80\x02ctorch\nSize\n}b.", "tries to change an allowlisted function"),
    # BUILD on an allowlisted class object itself, and NEWOBJ of a function: both refused
    (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n}b.", "not a readable pickle"),
    (b"\x80\x02ctorch\nSize\n)\x81.", "not a readable pickle"),
    (b"\x80\x02}.", "holds a dict, not DCP Metadata"),
    (b"\x80\x02ctorch\nSize\n", "not a readable pickle"),  # truncated
])
def test_hand_made_hostile_metadata_is_refused(tmp_path, data, message):
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(data)
    with pytest.raises(CheckpointError, match=message):
        import_dcp(str(tmp_path / "dcp"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_file_outside_the_directory_is_never_read_and_urls_are_sources(tmp_path):
    src = tmp_path / "dcp"
    _plain_dcp(str(src))
    import fsspec
    fs = fsspec.filesystem("memory")
    for name in os.listdir(src):
        fs.pipe(f"/dcp-import-test/{name}", (src / name).read_bytes())
    stats = import_dcp("memory:///dcp-import-test", str(tmp_path / "from-url"))
    assert stats.tensors == 22 and verify_checkpoint(str(tmp_path / "from-url")).fully_checked
    md = pickle.loads((src / ".metadata").read_bytes())  # the test's own file; torch reads it here
    next(iter(md.storage_data.values())).relative_path = "../secret.distcp"
    (src / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"'\.\./secret\.distcp' is not a plain file name"):
        import_dcp(str(src), str(tmp_path / "out"))


def test_what_import_dcp_does_not_read_is_refused_by_name(tmp_path, capsys):
    src = tmp_path / "dcp"
    _plain_dcp(str(src))
    md = pickle.loads((src / ".metadata").read_bytes())  # the test's own file; torch reads it here
    next(iter(md.storage_data.values())).transform_descriptors = ["zstd"]
    (src / ".metadata").write_bytes(pickle.dumps(md))
    assert "storage extensions ['zstd']" in _one_line_error(capsys, ["import-dcp", str(src), str(tmp_path / "o")])
    (src / ".metadata").rename(src / "__0.metadata")
    assert "rank-local __<rank>.metadata" in _one_line_error(capsys, ["import-dcp", str(src), str(tmp_path / "o")])
