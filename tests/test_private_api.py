"""torch private APIs appear in library code only inside compat modules (issue 14.1).

A torch release may change or remove any private name without notice. shardwise keeps every
use of one behind a module named ``_compat.py`` (``composable/_compat.py``, and one per package
that needs it), where a test per helper (``tests/test_dropin_compat.py``) states what shardwise
relies on. This test reads the library source and fails listing every private name found
anywhere else, docstrings and comments included (a name there is a dependency waiting to
happen, or a stale description).
"""

from __future__ import annotations

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


def test_scanner_finds_a_private_name(tmp_path):
    # the scanner itself: a file naming one is reported, a _compat.py module is not
    (tmp_path / "a.py").write_text("set_local_tensor(p, t)\nfrom torch.distributed.tensor._utils import f\n")
    (tmp_path / "_compat.py").write_text("from torch.autograd import Variable\nVariable._execution_engine\n")
    got = private_uses([tmp_path / "a.py", tmp_path / "_compat.py"])
    assert len(got) == 1 and got[0].endswith(":2: torch.distributed.tensor._"), got


def test_library_names_no_torch_private_api_outside_compat():
    files = list(_library_files())
    assert len(files) > 20, f"found only {len(files)} library files under {ROOT}: wrong root?"
    found = private_uses(files)
    assert not found, (
        "torch private APIs named outside a _compat.py module (move the use into the package's "
        "_compat.py with a test of what it relies on, or use a public API):\n  " + "\n  ".join(found))
