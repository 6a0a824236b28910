"""Which ``save_pretrained`` forms ``FSDP<cls>`` takes over (composable/_fsdp/_hf_save.py), without
transformers or PEFT: a class whose ``save_pretrained`` takes ``state_dict=`` (transformers'
form) or reads it from ``**kwargs`` beside ``is_main_process`` (PEFT's form) gets the full state
dict on rank 0 and ``{}`` elsewhere, with ``is_main_process`` true on rank 0 only; other forms
keep their own method."""

from __future__ import annotations

import torch
import torch.nn as nn

from shardwise.composable._fsdp._hf_save import save_pretrained_override
from tests._dist import run_ranks


class _PeftLike(nn.Module):
    """PEFT's form: ``state_dict`` travels in ``**kwargs``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)
        self.head.weight.requires_grad_(False)

    def save_pretrained(self, save_directory, safe_serialization=True, is_main_process=True, **kwargs):
        sd = kwargs.get("state_dict")
        return {"dir": save_directory, "main": is_main_process,
                "sd": None if sd is None else {k: (type(v).__name__, tuple(v.shape)) for k, v in sd.items()},
                "rest": sorted(k for k in kwargs if k != "state_dict")}


class _TransformersLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 6)

    def save_pretrained(self, save_directory, is_main_process=True, state_dict=None, **kwargs):
        return {"main": is_main_process, "keys": sorted(state_dict)}


class _KwargsOnly(nn.Module):
    def save_pretrained(self, save_directory, **kwargs):
        return "own"


class _NoStateDict(nn.Module):
    def save_pretrained(self, save_directory, is_main_process=True):
        return "own"


def test_which_forms_are_taken_over():
    assert set(save_pretrained_override(_PeftLike)) == {"save_pretrained"}
    assert set(save_pretrained_override(_TransformersLike)) == {"save_pretrained"}
    assert save_pretrained_override(_KwargsOnly) == {}, "**kwargs without is_main_process: not a known form"
    assert save_pretrained_override(_NoStateDict) == {}
    assert save_pretrained_override(nn.Linear) == {}


def _save(rank, world_size):
    from shardwise.composable import fully_shard

    torch.manual_seed(0)
    peft, tf = _PeftLike(), _TransformersLike()
    for m in (peft, tf):
        fully_shard(m.inner)
        fully_shard(m)
    out = {"bare": peft.save_pretrained("d"),
           "main_true": peft.save_pretrained("d", is_main_process=True, push=1),
           "main_false": peft.save_pretrained("d", is_main_process=False),
           "given": peft.save_pretrained("d", state_dict={"x": torch.ones(2)}),
           "transformers": tf.save_pretrained("d")}
    return out


def test_peft_form_gets_the_full_state_dict_on_rank0_only():
    r0, r1 = run_ranks(_save, 2)
    full = {"inner.weight": ("Tensor", (6, 4)), "inner.bias": ("Tensor", (6,)),
            "head.weight": ("Tensor", (3, 6)), "head.bias": ("Tensor", (3,))}
    assert r0["bare"] == {"dir": "d", "main": True, "sd": full, "rest": []}, r0["bare"]
    assert r1["bare"] == {"dir": "d", "main": False, "sd": {}, "rest": []}, r1["bare"]
    assert r0["main_true"]["main"] and not r1["main_true"]["main"] and r0["main_true"]["rest"] == ["push"]
    assert not r0["main_false"]["main"] and not r1["main_false"]["main"], "is_main_process=False is kept"
    assert r0["given"]["sd"] == r1["given"]["sd"] == {"x": ("Tensor", (2,))}, "a given state_dict is used as is"
    assert r0["transformers"] == {"main": True, "keys": ["inner.bias", "inner.weight"]}
    assert r1["transformers"] == {"main": False, "keys": []}
