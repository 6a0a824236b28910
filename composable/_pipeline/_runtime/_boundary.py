"""The check that a non-last stage's output is its last block's output, on the first step.

[Note: work between blocks]
A split stage sends on what its last block returned (`_pipeline/_split/_split.py`: the output is captured by
a hook on that block), and the next stage's first block takes it as its input. That is only
the unsplit model's computation if the model's ``forward`` passes each block's output
straight on: ``h = block(h)``. A loop such as ``h = torch.tanh(block(h))``, or a scale applied
to the hidden state outside a module, would be skipped at every stage boundary, and training
would go on with wrong gradients and no error. On a stage before the last, the post-modules
are identities, so what the shell's forward returns is the last block's output passed through
whatever the model does after its blocks: if that is not the same values, the model does work
on the hidden state that the split cannot place. The first step checks it on every such
stage (cheap: the same storage, or one comparison) and refuses with the fix, on every rank
(the runtime reports a stage's error to all of them).
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
