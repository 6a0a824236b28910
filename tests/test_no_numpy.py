"""The library runs without numpy: it is not a dependency, and a user's fresh venv may lack it.

torch works without numpy (it warns once), so any ``Tensor.numpy()`` left in library code fails
only on such machines. Each test runs a child interpreter in which ``import numpy`` raises.
"""

import subprocess
import sys
import textwrap

_BLOCK = "import sys; sys.modules['numpy'] = None  # import numpy -> ImportError\n"


def _run(body: str, tmp_path) -> None:
    code = _BLOCK + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"child failed without numpy:\n{done.stdout}\n{done.stderr}"
    assert "OK" in done.stdout, done.stdout


def test_checkpoint_save_load_and_tools_without_numpy(tmp_path):
    _run("""
        import torch
        import shardwise.checkpoint as ckpt
        from shardwise.checkpoint._base import _comm
        g = torch.Generator().manual_seed(0)
        state = {"w": torch.randn(5, 3, generator=g), "b": torch.arange(4, dtype=torch.int64), "step": 7,
                 "h": torch.randn(3, generator=g).to(torch.bfloat16)}
        ckpt.save(state, "ck")
        out = {"w": torch.zeros(5, 3), "b": torch.zeros(4, dtype=torch.int64), "step": 0,
               "h": torch.zeros(3, dtype=torch.bfloat16)}
        ckpt.load(out, "ck")
        assert all(torch.equal(out[k], state[k]) for k in ("w", "b", "h")), out
        assert ckpt.verify_checkpoint("ck").ok
        ckpt.merge_checkpoint("ck", "merged")
        assert _comm._decode(_comm._encode({"a": [1, 2]})) == {"a": [1, 2]}
        print("OK")
    """, tmp_path)
