"""The multi-stage zero-bubble schedules at pp=4 (4 ranks, 8 virtual stages; zbv and dualpipev in
their V, interleaved_zb in a loop) against one process on the whole batch (losses and every
gradient to 1e-6; the stages together hold exactly the model's parameters). With fully_shard and
with TP they are tested at pp=2 on 4 ranks in test_pipeline_zb.py."""

from __future__ import annotations

import pytest

from examples.model import LlamaConfig
from tests._dist import run_ranks
from tests.test_pipeline import _check, _run

CFG8 = LlamaConfig(vocab_size=17, dim=16, n_layers=8, n_heads=4, n_kv_heads=2, ffn_hidden=24, max_seq_len=16)


@pytest.mark.parametrize("opts", [
    {"schedule": "zbv", "v": 2, "placement": "v", "m": 8},
    {"schedule": "interleaved_zb", "v": 2, "m": 8},
    {"schedule": "dualpipev", "v": 2, "placement": "v", "m": 8},
], ids=["zbv-pp4", "izb-pp4", "dualpipev-pp4"])
def test_multi_stage_zero_bubble_at_pp4_matches_one_process(opts):
    res = run_ranks(_run, 4, {"pp": 4, "cfg": CFG8, **opts}, timeout=180)
    _check(res, cfg=CFG8)
