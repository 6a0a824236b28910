"""The check that a non-last stage's output is its last block's output, on the first step.

[Note: work between blocks]
A stage sends what its last block returned, so the split is the unsplit model only if its
``forward`` passes each block's output straight on (``h = block(h)``); ``h = torch.tanh(block(h))``
would be skipped silently at every boundary. With the post-modules as identities, the shell's
output must equal the last block's; the first step checks it (same storage, or one comparison)
and refuses with the fix on every rank.
"""

from __future__ import annotations

import torch

__all__ = ["check_boundary"]


def check_boundary(stage: int, shell_out: torch.Tensor | None, block_out: torch.Tensor) -> None:
    """Raise if ``shell_out`` (the stage's forward output) does not hold ``block_out``'s values."""
    if shell_out is block_out:
        return
    if hasattr(shell_out, "to_local") and hasattr(block_out, "to_local"):  # DTensors (tensor-parallel stages)
        shell_out, block_out = shell_out.to_local(), block_out.to_local()  # type: ignore[union-attr]
    same = (isinstance(shell_out, torch.Tensor) and shell_out.shape == block_out.shape
            and (shell_out.data_ptr() == block_out.data_ptr() and shell_out.stride() == block_out.stride()
                 or torch.equal(shell_out.detach().to(block_out.dtype), block_out.detach())))
    if not same:
        raise ValueError(
            f"pipeline: stage {stage}'s forward changes its last block's output outside a module (e.g. "
            "h = torch.tanh(block(h)) in the model's loop, or a scale after the loop), and a split stage sends the "
            "block's output as is, so the next stage would compute something else; move that operation into the "
            "block (or into a module after the blocks, such as the final norm), or use pp=1")
