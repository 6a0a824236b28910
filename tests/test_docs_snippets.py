"""Every ```python snippet of README.md and docs/*.md runs as written, on 2 real gloo ranks.

The convention (documented in docs/testing.md, "Snippets in the docs"): an HTML comment on the
line right before a ```python fence says how the snippet runs; without one it runs as is.

    <!-- snippet: skip (reason) -->          not run; the reason is required
    <!-- snippet: needs model, sharded -->   these setups (`SETUPS`) run first, in its namespace
    <!-- snippet: ranks 4 -->                world size (default 2); parts combine with ";"

Each snippet runs in a fresh namespace and its own empty working directory (a temporary
directory, never the repository root), on ranks that have torchrun's variables but no process
group: a snippet (or its setup) must call ``init_distributed()`` itself, as a script would. The
group is destroyed after each snippet. All snippets of one world size share one launch of ranks
(about a second per snippet). A snippet's own code imports only installed packages: not
``examples``, ``tests`` or ``benchmarks``, which exist only in a clone of the repository (the
harness has them on ``sys.path``, a user's fresh directory does not); setups may.
"""

from __future__ import annotations

import ast
import os
import re
import socket
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests._dist import run_ranks

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DEFAULT_RANKS = 2
MARK = re.compile(r"^<!--\s*snippet:\s*(?P<body>.*?)\s*-->\s*$")

# name -> (setups it builds on, code). Each names what it defines; snippets that are parts of
# a page (a section that continues the page's first example) say which they need.
SETUPS: dict[str, tuple[tuple[str, ...], str]] = {
    # torch, nn, F
    "torch": ((), "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"),
    # every public name of shardwise, and DTensor's placements (a page's earlier imports)
    "shardwise": (("torch",), (
        "from torch.distributed.tensor import Partial, Replicate, Shard\n"
        "from shardwise.composable import *\nfrom shardwise.mesh import *\nfrom shardwise.checkpoint import *\n")),
    # cfg, Llama, LlamaConfig, build_model(), build_pretrained(), model (plain, unsharded),
    # block (= model.layers[0]), tokens, targets, micro_batches, loss_fn(output, targets=None)
    "model": (("torch",), """
from examples.model import Llama, LlamaConfig
cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
def build_model():
    return Llama(cfg, generator=torch.Generator().manual_seed(0))
build_pretrained = build_model
model = build_model()
block = model.layers[0]
tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
targets = tokens.roll(-1, dims=1)
micro_batches = list(tokens.chunk(2))
def loss_fn(output, targets=None):
    '''cross-entropy of logits against targets; without targets, the mean square of the output'''
    if targets is None:
        return output.float().square().mean()
    return F.cross_entropy(output.flatten(0, 1).float(), targets.flatten())
"""),
    # model + rank, world_size (init_distributed), dp_mesh (1-D, all ranks); no shardwise names:
    # a snippet that uses them imports them or also needs "shardwise"
    "dp_mesh": (("model",), """
from shardwise.mesh import data_parallel_mesh as _dp, init_distributed as _init, init_mesh as _mesh
rank, world_size = _init()
dp_mesh = _dp(_mesh(dp_shard=-1))
"""),
    # dp_mesh + model sharded (each block, then the root), optim (AdamW)
    "sharded": (("dp_mesh",), """
from shardwise.composable import fully_shard as _fully_shard
for _block in model.layers:
    _fully_shard(_block, mesh=dp_mesh)
_fully_shard(model, mesh=dp_mesh)
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
"""),
    # sharded + step = 100 (a checkpoint snippet saves step-{step} and loads step-100)
    "step": (("sharded",), "step = 100\n"),
    # dp_mesh + path/to/hf_model/model.safetensors: a save_pretrained-style file of build_model()
    "hf_model": (("dp_mesh",), """
import safetensors.torch as _st
import torch.distributed as _dist
if rank == 0:
    os.makedirs("path/to/hf_model")
    _st.save_file({k: v.clone() for k, v in build_model().state_dict().items()},
                  "path/to/hf_model/model.safetensors")
_dist.barrier()
"""),
    # apply_tp, apply_fsdp: the two steps of examples/parallel.py (a page that shows the example's code)
    "parallel_example": ((), "from examples.parallel import apply_fsdp, apply_tp\n"),
    # TinyMoE, moe_local_forward (tests/test_tp.py), rank, world_size, tp_mesh (all ranks),
    # model (a net whose .moe is a TinyMoE)
    "moe": (("torch",), """
from tests.test_tp import MoENet as _MoENet, TinyMoE, moe_local_forward
from shardwise.mesh import init_distributed as _init, init_mesh as _mesh
rank, world_size = _init()
tp_mesh = _mesh(dp_shard=1, tp=world_size)["tp"]
model = _MoENet(n_experts=3)
"""),
}


@dataclass(frozen=True)
class Snippet:
    file: str  # relative to the repository root
    line: int  # of the ```python fence, 1-based
    code: str
    needs: tuple[str, ...] = ()
    ranks: int = DEFAULT_RANKS
    skip: str | None = None

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def parse_marker(body: str, where: str) -> dict:
    """The fields a ``<!-- snippet: body -->`` comment sets; ValueError names what is wrong."""
    out: dict = {}
    for part in (p.strip() for p in body.split(";")):
        if m := re.fullmatch(r"skip\s*\((.*\S.*)\)", part):
            out["skip"] = m.group(1).strip()
        elif m := re.fullmatch(r"needs\s+([\w\s,]+)", part):
            names = tuple(n.strip() for n in m.group(1).split(",") if n.strip())
            unknown = [n for n in names if n not in SETUPS]
            if unknown:
                raise ValueError(f"{where}: unknown setup {unknown}; known: {sorted(SETUPS)}")
            out["needs"] = names
        elif m := re.fullmatch(r"ranks\s+([1-8])", part):
            out["ranks"] = int(m.group(1))
        else:
            raise ValueError(f"{where}: cannot read '{part}'; use 'skip (reason)', 'needs a, b' or 'ranks N'")
    return out


def collect(paths=DOCS) -> list[Snippet]:
    """Every ```python snippet of ``paths`` with its marker. ValueError for a marker that is
    malformed or not right before a ```python fence."""
    found = []
    for path in paths:
        lines = Path(path).read_text().splitlines()
        rel = str(Path(path).relative_to(ROOT)) if Path(path).is_relative_to(ROOT) else str(path)
        fence = None
        for i, text in enumerate(lines):
            if fence is not None:
                if text.strip().startswith("```"):
                    found.append(Snippet(rel, fence[0] + 1, "\n".join(lines[fence[0] + 1:i]) + "\n", **fence[1]))
                    fence = None
                continue
            if text.startswith("```python"):
                marker = MARK.match(lines[i - 1]) if i else None
                fields = parse_marker(marker.group("body"), f"{rel}:{i}") if marker else {}
                fence = (i, fields)
            elif MARK.match(text) and not (i + 1 < len(lines) and lines[i + 1].startswith("```python")):
                raise ValueError(f"{rel}:{i + 1}: a snippet marker must be the line right before a ```python fence")
    return found


def setup_code(needs: tuple[str, ...]) -> list[tuple[str, str]]:
    """``(name, code)`` of the setups ``needs`` asks for, dependencies first, each once."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name not in order:
            for dep in SETUPS[name][0]:
                visit(dep)
            order.append(name)

    for n in needs:
        visit(n)
    return [(n, SETUPS[n][1]) for n in order]


def _agree_on_port(rank: int, path: str, timeout: float = 60.0) -> int:
    """A free port for the next rendezvous: rank 0 picks it just before use (a port picked long
    before could meanwhile be taken as an ephemeral port) and publishes it in ``path``."""
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with open(path + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(path + ".tmp", path)
        return port
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 published no port in {path}")
        time.sleep(0.01)
    with open(path) as f:
        return int(f.read())


def _run_snippets(rank, world_size, snippets, workdir):
    """Each snippet in turn: fresh namespace and directory, its own rendezvous port; returns
    ``{id: traceback}`` of the ones that raised."""
    import torch.distributed as dist

    errors = {}
    home = os.getcwd()
    for n, s in enumerate(snippets):
        here = os.path.join(workdir, f"{n:02d}")
        os.makedirs(here, exist_ok=True)
        port = _agree_on_port(rank, os.path.join(workdir, f"port-{n:02d}"))
        os.chdir(here)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        ns = {"__name__": "__snippet__", "os": os}
        ok = False
        try:
            for name, code in setup_code(s.needs):
                exec(compile(code, f"<setup {name}>", "exec"), ns)
            exec(compile(s.code, s.id, "exec"), ns)
            ok = True
        except BaseException:
            errors[s.id] = traceback.format_exc()
        finally:
            os.chdir(home)
            if dist.is_initialized():
                if ok:
                    dist.barrier()
                dist.destroy_process_group()
    return errors


SNIPPETS = collect()
REPOSITORY_ONLY = ("examples", "tests", "benchmarks")


def repository_imports(code: str) -> list[str]:
    """The modules of `REPOSITORY_ONLY` that ``code`` imports (a user outside the repository
    has none of them)."""
    found = []
    for node in ast.walk(ast.parse(code)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        found += [n for n in names if n.split(".")[0] in REPOSITORY_ONLY]
    return found


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Run every snippet that is not skipped: one launch of ranks per world size."""
    errors = {}
    by_ranks: dict[int, list[Snippet]] = {}
    for s in SNIPPETS:
        if s.skip is None:
            by_ranks.setdefault(s.ranks, []).append(s)
    for ranks, group in sorted(by_ranks.items()):
        work = tmp_path_factory.mktemp(f"snippets{ranks}")
        got = run_ranks(_run_snippets, ranks, group, str(work),
                        init_group=False, timeout=30.0 + 10.0 * len(group))
        for rank_errors in got:
            for key, text in rank_errors.items():
                errors.setdefault(key, text)
    return errors


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_snippet_runs(snippet, outcomes):
    if snippet.skip is not None:
        pytest.skip(f"marked: {snippet.skip}")
    assert not repository_imports(snippet.code), (
        f"{snippet.id} imports {repository_imports(snippet.code)}, which exist only inside the repository: a user "
        "running it from a fresh directory gets ModuleNotFoundError. Define what it needs in the snippet, or use a "
        "setup (`<!-- snippet: needs ... -->`)")
    assert snippet.id not in outcomes, (
        f"{snippet.id} fails as written (needs: {', '.join(snippet.needs) or 'nothing'}):\n{outcomes[snippet.id]}")


def test_convention_catches_unmarked_broken_snippets(tmp_path):
    """The collector finds unmarked snippets (they run with nothing defined), reads markers, and
    refuses malformed ones; the runner reports a snippet that raises."""
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\nundefined_name\n```\n\n<!-- snippet: needs model; ranks 1 -->\n"
                    "```python\nassert model is not None\n```\n\n<!-- snippet: skip (a signature) -->\n"
                    "```python\nf(x) -> y\n```\n")
    a, b, c = collect([page])
    assert (a.needs, a.ranks, a.skip) == ((), 2, None) and a.code == "undefined_name\n", a
    assert (b.needs, b.ranks, b.skip) == (("model",), 1, None), b
    assert c.skip == "a signature", c
    errors = run_ranks(_run_snippets, 1, [a, b], str(tmp_path), init_group=False)[0]
    assert set(errors) == {a.id} and "NameError" in errors[a.id], errors
    assert repository_imports("import examples.model\nfrom tests._dist import run_ranks\nimport torch\n"
                              "from . import x\n") == ["examples.model", "tests._dist"]
    for bad in ("skip", "skip ()", "needs nothing_like_this", "ranks 99", "run fast"):
        page.write_text(f"<!-- snippet: {bad} -->\n```python\npass\n```\n")
        with pytest.raises(ValueError):
            collect([page])
    page.write_text("<!-- snippet: needs model -->\n\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="right before"):
        collect([page])


def test_readme_commands_match_ci_and_name_both_torch_wheels():
    """The README's test command is .ci/run's command line, and the README gives a CPU-only
    user the same command with torch's CPU wheel index."""
    readme = (ROOT / "README.md").read_text()
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m venv")]
    assert len(ci) == 1, ci
    bash = re.findall(r"```bash\n(.*?)```", readme, re.S)
    commands = [line for block in bash for line in block.splitlines()]
    assert ci[0] in commands, "the README's test command differs from .ci/run's"
    cpu = ci[0].replace("pip install torch==2.13.0 ",
                        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu ")
    assert cpu != ci[0] and cpu in commands, "no CPU-only install command in the README"
    assert "GPU" in readme and "CPU-only" in readme
