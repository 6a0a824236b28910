"""torch private APIs appear in library code only inside compat modules (issue 14.1).

A torch release may change or remove any private name without notice. shardwise keeps every
use of one behind a module named ``_compat.py`` (``composable/_compat.py``, and one per package
that needs it), where a test per helper (``tests/test_dropin_compat.py``) states what shardwise
relies on. This test reads the library source and fails listing every private name found
anywhere else, in two ways:

* by name, docstrings and comments included (a name there is a dependency waiting to happen,
  or a stale description): the names on the ``PRIVATE`` list, which also catches private
  attributes reached through a plain variable (``t._local_tensor``);
* by syntax, for any private name at all: an import of a torch module whose path has a private
  part (``torch.distributed._functional_collectives``), an imported private name
  (``from torch.distributed.tensor import _utils``), and an attribute chain with a private part
  rooted in a name bound to a torch module or object (``dist._world``,
  ``DTensor._op_dispatcher``), whether or not it is on the list.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("composable", "mesh", "checkpoint")

# torch private names shardwise has used or is tempted to use; a compat module fences them.
PRIVATE = (
    "_StridedShard",
    "_get_root_mesh",
    "_mesh_resources",
    "_execution_engine",
    "_local_tensor",
    "_cdata",
    "torch._foreach",
    "compute_local_shape_and_global_offset",
    "_local_shard_size_and_offset",
    "torch.distributed.tensor._",
    "torch._dynamo",
    "torch._C",
    "torch.utils._",
    "_saved_",  # autograd nodes' saved tensors (the split backward's weight gradients)
    "_input_metadata",
    "_engine_run_backward",
)
# a name counts where it starts a word: ``_local_tensor`` is not in ``set_local_tensor``
_PATTERN = re.compile(r"(?<![A-Za-z0-9_])(?:" + "|".join(re.escape(n) for n in PRIVATE) + ")")


def _library_files():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def private_uses(files) -> list[str]:
    """``path:line: name`` for every private name in ``files`` outside ``_compat.py`` modules."""
    found = []
    for path in files:
        if path.name == "_compat.py":
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            for m in _PATTERN.finditer(line):
                name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                found.append(f"{name}:{no}: {m.group(0)}")
    return found


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def private_syntax(files) -> list[str]:
    """``path:line: dotted.name`` for every private torch name the syntax of ``files`` reaches
    (see the module docstring), outside ``_compat.py`` modules."""
    found = []
    for path in files:
        if path.name == "_compat.py":
            continue
        tree = ast.parse(path.read_text())
        bound: dict[str, str] = {}  # local name -> the torch path it is bound to
        hits: set[tuple[int, str]] = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                for a in n.names:
                    if a.name.split(".")[0] != "torch":
                        continue
                    if any(map(_private, a.name.split("."))):
                        hits.add((n.lineno, a.name))
                    bound[a.asname or "torch"] = a.name if a.asname else "torch"
            elif isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] == "torch":
                assert n.module is not None
                if any(map(_private, n.module.split("."))):
                    hits.add((n.lineno, n.module))
                    continue
                for a in n.names:
                    if _private(a.name):
                        hits.add((n.lineno, f"{n.module}.{a.name}"))
                    else:
                        bound[a.asname or a.name] = f"{n.module}.{a.name}"
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for n in ast.walk(tree):
            if not isinstance(n, ast.Attribute) or id(n) in inner:  # the whole chain, once
                continue
            chain, root = [], n
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound and any(map(_private, chain)):
                hits.add((n.lineno, ".".join([bound[root.id], *reversed(chain)])))
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        found += [f"{name}:{no}: {what}" for no, what in sorted(hits)]
    return found


def test_syntax_scanner_finds_private_names_off_the_list(tmp_path):
    planted = ("import torch\nimport torch.distributed as dist\n"
               "from torch.distributed.tensor import DTensor, _utils\n"
               "import torch.distributed._functional_collectives as fc\n"
               "from torch._prims_common import x\n"
               "dist._world.pg_map\nDTensor._op_dispatcher\ntorch.nn.Module.__init__\nt._local\n")
    (tmp_path / "a.py").write_text(planted)
    (tmp_path / "_compat.py").write_text(planted)
    got = [g.split(": ", 1)[1] for g in private_syntax([tmp_path / "a.py", tmp_path / "_compat.py"])]
    assert got == ["torch.distributed.tensor._utils", "torch.distributed._functional_collectives",
                   "torch._prims_common", "torch.distributed._world.pg_map",
                   "torch.distributed.tensor.DTensor._op_dispatcher"], got


def test_scanner_finds_a_private_name(tmp_path):
    # the scanner itself: a file naming one is reported, a _compat.py module is not
    (tmp_path / "a.py").write_text("set_local_tensor(p, t)\nfrom torch.distributed.tensor._utils import f\n")
    (tmp_path / "_compat.py").write_text("from torch.autograd import Variable\nVariable._execution_engine\n")
    got = private_uses([tmp_path / "a.py", tmp_path / "_compat.py"])
    assert len(got) == 1 and got[0].endswith(":2: torch.distributed.tensor._"), got


def test_library_names_no_torch_private_api_outside_compat():
    files = list(_library_files())
    assert len(files) > 20, f"found only {len(files)} library files under {ROOT}: wrong root?"
    found = private_uses(files) + private_syntax(files)
    assert not found, (
        "torch private APIs named outside a _compat.py module (move the use into the package's "
        "_compat.py with a test of what it relies on, or use a public API):\n  " + "\n  ".join(found))
