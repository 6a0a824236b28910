"""What ``composable/_tp/_compat.py`` relies on in the installed torch (one test per helper)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate

from shardwise.composable._tp._compat import current_mesh
from tests._dist import run_ranks
from tests._models import make_mesh


def _nested_meshes(rank, world):
    outer, inner = make_mesh((world,)), make_mesh((world,))
    seen = [current_mesh()]
    with outer:
        seen.append(current_mesh())
        with inner:
            seen.append(current_mesh())
        seen.append(current_mesh())
    seen.append(current_mesh())
    return [None if m is None else ("outer" if m is outer else "inner" if m is inner else "other") for m in seen]


def test_current_mesh_follows_with_blocks_innermost_first():
    for r in run_ranks(_nested_meshes, 2):
        assert r == [None, "outer", "inner", "outer", None], r


def test_torch_style_kind_fields_and_overrides_match_the_installed_torch():
    """``torch_style_kind`` finds torch's class by module and name (also through a subclass),
    ``torch_style_fields`` reads the arguments torch keeps, ``torch_style_overrides`` names
    exactly what a subclass redefines."""
    import torch.distributed.tensor.parallel as torch_tp
    from torch.distributed.tensor import Replicate, Shard

    from shardwise.composable._tp._compat import (TORCH_STYLE_MODULE, torch_style_fields, torch_style_kind,
                                                  torch_style_overrides)

    assert torch_tp.ColwiseParallel.__module__ == TORCH_STYLE_MODULE

    class Cast(torch_tp.RowwiseParallel):
        @staticmethod
        def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
            return inputs

    row = Cast(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
    assert torch_style_kind(row) == "RowwiseParallel" and torch_style_kind(object()) is None
    assert torch_style_fields(row, "RowwiseParallel") == {
        "input_layouts": (Replicate(),), "output_layouts": (Shard(1),), "use_local_output": False}
    assert set(torch_style_overrides(row, "RowwiseParallel")) == {"_prepare_input_fn"}
    assert torch_style_overrides(torch_tp.ColwiseParallel(), "ColwiseParallel") == {}
    assert torch_style_fields(torch_tp.ColwiseParallel(), "ColwiseParallel") == {
        "input_layouts": (Replicate(),), "output_layouts": (Shard(-1),), "use_local_output": True}
    assert torch_style_fields(torch_tp.SequenceParallel(sequence_dim=2), "SequenceParallel") == {
        "sequence_sharding": (Shard(2),), "use_local_output": False}
    prep = torch_tp.PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                       input_kwarg_layouts={"m": Shard(0)}, desired_input_kwarg_layouts={"m": Replicate()})
    assert torch_style_fields(prep, "PrepareModuleInput") == {
        "input_layouts": (Shard(1), None), "desired_input_layouts": (Replicate(), None),
        "input_kwarg_layouts": {"m": Shard(0)}, "desired_input_kwarg_layouts": {"m": Replicate()},
        "use_local_output": False}
    out = torch_tp.PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
    assert torch_style_fields(out, "PrepareModuleOutput") == {
        "output_layouts": (Shard(1),), "desired_output_layouts": (Replicate(),), "use_local_output": True}
    both = torch_tp.PrepareModuleInputOutput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                             output_layouts=Shard(1), desired_output_layouts=Replicate())
    halves = torch_style_fields(both, "PrepareModuleInputOutput")
    assert [torch_style_kind(h) for h in halves.values()] == ["PrepareModuleInput", "PrepareModuleOutput"]


def _apply_overrides(rank, world):
    import torch.distributed.tensor.parallel as torch_tp
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate

    from shardwise.composable import ColwiseParallel, parallelize_module
    from shardwise.composable._tp._compat import style_hooks

    mesh, seen = make_mesh((world,)), []

    class Checked(torch_tp.ColwiseParallel):  # torchao's float8 styles' shape: check, then torch's _apply
        def _apply(self, module, device_mesh):
            seen.append(("torch", type(module).__name__, self.src_data_rank, device_mesh is mesh))
            if not isinstance(module, nn.Linear):
                raise ValueError(f"Expecting module to be nn.Linear but found {type(module)}")
            return super()._apply(module, device_mesh)

    class Rebound(ColwiseParallel):  # the same, written against shardwise's class (names rebound)
        def _apply(self, module, device_mesh):
            seen.append(("shardwise", type(module).__name__, self.src_data_rank, device_mesh is mesh))
            return super()._apply(module, device_mesh)

        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            seen.append(("output hook", tuple(output_layouts), use_local_output))
            return outputs.redistribute(placements=output_layouts).to_local()

    style = Checked()
    a = parallelize_module(nn.Linear(4, 4), mesh, style, src_data_rank=None)
    b = parallelize_module(nn.Sequential(nn.Linear(4, 4)), mesh, {"0": Rebound(output_layouts=Replicate())})
    b(torch.ones(2, 4))
    try:
        parallelize_module(nn.Sequential(nn.Embedding(4, 4)), mesh, {"0": Checked()})
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    assert not hasattr(style, "src_data_rank") or type(style) is Checked, "the style object itself is not changed"
    return {"seen": seen, "dtensor": isinstance(a.weight, DTensor) and isinstance(b[0].weight, DTensor),
            "refused": refused, "hooks": [h is not None for h in style_hooks(Rebound())],
            "none": style_hooks(ColwiseParallel()) == (None, None)}


def test_an_apply_override_runs_with_shardwise_standing_in_for_its_base_class():
    """``run_apply_override``: a style subclass's ``_apply`` (torch's class or shardwise's as its
    base) runs, sees ``src_data_rank`` as torch's ``parallelize_module`` sets it, and its
    ``super()._apply`` applies shardwise's rule; what it refuses is refused. ``style_hooks``
    finds torch's forward hooks on a subclass."""
    r = run_ranks(_apply_overrides, 1)[0]
    assert r["seen"] == [("torch", "Linear", None, True), ("shardwise", "Linear", 0, True),
                         ("output hook", (Replicate(),), True), ("torch", "Embedding", 0, True)], r["seen"]
    assert r["dtensor"] and r["hooks"] == [False, True] and r["none"], r
    assert r["refused"] == "Expecting module to be nn.Linear but found <class 'torch.nn.modules.sparse.Embedding'>", r
