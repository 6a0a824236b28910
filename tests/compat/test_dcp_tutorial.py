"""Differential: the torch FSDP2 + DCP tutorial script (``_dcp_tutorial.py``) written once, run
with torch's imports and with only its import lines changed to shardwise's. Both give the same
losses; each resumes from its sync and its async checkpoint with the uninterrupted losses, and
the async checkpoint loads back bit-exact."""

from __future__ import annotations

import pathlib
import re

import pytest

from tests._compare import rel_errs
from tests._dist import run_on_workers
from tests.compat._rebind import assert_ran

SCRIPT = pathlib.Path(__file__).with_name("_dcp_tutorial.py")
WORLD = 2
IMPORTS = re.compile(r"# -- imports: torch's\n(.*?)# -- imports: end\n", re.S)


def source(name: str) -> str:
    """The script's text for implementation ``name``: for shardwise only the import block differs."""
    text = SCRIPT.read_text()
    if name == "torch":
        return text
    shardwise = re.search(r'SHARDWISE_IMPORTS = """\\\n(.*?)"""', text, re.S)
    assert shardwise is not None and IMPORTS.search(text) is not None, "the script lost its import markers"
    return IMPORTS.sub(lambda m: f"# -- imports: shardwise's\n{shardwise.group(1)}# -- imports: end\n", text, count=1)


def _run(rank, world_size, name, ckpt_dir):
    namespace: dict = {"__name__": f"dcp_tutorial_{name}"}
    exec(compile(source(name), f"<dcp tutorial, {name}>", "exec"), namespace)
    built, build = [], namespace["build"]
    namespace["build"] = lambda seed: built.append(build(seed)) or built[-1]  # main looks it up at call time
    out = namespace["main"](ckpt_dir)
    # in the rank: every model the script built was sharded by `name`'s fully_shard
    out["ran"] = [assert_ran(name, model) for model, _ in built]
    return out


def test_only_the_imports_differ():
    torch_lines = source("torch").splitlines()
    sw_lines = source("shardwise").splitlines()
    changed = [(a, b) for a, b in zip(torch_lines, sw_lines) if a != b]
    assert len(torch_lines) == len(sw_lines) and changed, "the two versions must differ in the import lines only"
    assert all(a.startswith(("import ", "from ", "# -- imports")) and b.startswith(("import ", "from ", "# -- imports"))
               for a, b in changed), changed
    assert "torch.distributed" not in "\n".join(b for _, b in changed)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name in ("torch", "shardwise"):
        path = str(tmp_path_factory.mktemp(f"tutorial-{name}"))
        out[name] = run_on_workers(_run, WORLD, name, path, timeout=180)
    return out


@pytest.mark.parametrize("name", ["torch", "shardwise"])
def test_resume_continues_with_identical_losses(runs, name):
    for rank, r in enumerate(runs[name]):
        losses, save_at = r["losses"], 2
        assert r["ran"] == [{"fsdp": [name], "tp": []}] * 3, f"{name} rank {rank}: the models were sharded by {r['ran']}"
        assert r["resumed"] == losses[save_at:], f"{name} rank {rank}: resumed {r['resumed']} vs {losses[save_at:]}"
        assert r["resumed_async"] == losses[save_at + 2:], f"{name} rank {rank}: from the async checkpoint"
        assert r["async_params_equal"], f"{name} rank {rank}: the async checkpoint did not load back bit-exact"


def test_shardwise_gives_torchs_losses(runs):
    want, got = runs["torch"][0]["losses"], runs["shardwise"][0]["losses"]
    assert rel_errs(got, want) <= 1e-6, f"shardwise {got} vs torch {want}"
