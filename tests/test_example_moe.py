"""``examples/train.py --experts 8 --top-k 2 --ep N`` trains with the same losses as ``--ep 1``
(FSDP only, every expert gathered) on the same 4 ranks, to 1e-6 in fp32, also with ``--tp 2``
(TP on attention and on each expert's weights); bad MoE flags exit 2."""

from __future__ import annotations

import pytest

from examples.moe import check_moe_args
from examples.preflight import UsageError
from tests._dist import run_ranks
from tests.test_example import ARGS, _main_job

MOE = ["--experts", "8", "--top-k", "2"]


def test_moe_example_ep_matches_fsdp_only():
    base = run_ranks(_main_job, 4, ARGS + MOE + ["--ep", "1"], timeout=120)[0]
    for ep in ("2",):
        got = run_ranks(_main_job, 4, ARGS + MOE + ["--ep", ep], timeout=120)[0]
        assert got == pytest.approx(base, rel=1e-6), (ep, got, base)
    assert len(base) == 4 and base[-1] < base[0], base


def test_moe_example_ep_x_tp_matches_one_tp_rank():
    """EP (2) x TP (2), the experts' own weights split over tp, on 4 ranks, and EP (1) x TP (2)
    (FSDP 2 on the experts), against ``--ep 1 --tp 1`` on 2 ranks: the same 2 dp ranks, so the
    same tokens per router."""
    base = run_ranks(_main_job, 2, ARGS + MOE + ["--ep", "1", "--tp", "1"], timeout=120)[0]
    for ep in ("2", "1"):
        got = run_ranks(_main_job, 4, ARGS + MOE + ["--ep", ep, "--tp", "2"], timeout=120)[0]
        assert got == pytest.approx(base, rel=1e-6), (ep, got, base)


def test_moe_example_ep_x_pp_matches_one_stage():
    """EP (2) x PP (2) on 4 ranks against ``--ep 1`` on 2 ranks (the same 2 dp
    ranks): every stage's load-balancing loss enters through its gradient (`MoEPipelineAux`)."""
    base = run_ranks(_main_job, 2, ARGS + MOE + ["--ep", "1"], timeout=120)[0]
    for ep in ("2",):
        out = run_ranks(_counting_job, 4, ARGS + MOE + ["--ep", ep, "--pp", "2"], timeout=120)
        got = out[0][0]
        assert got == pytest.approx(base, rel=1e-6), (ep, got, base)
        # per rank and step: its stage's block and stage root (dp 2); the experts' own unit
        # (ep 2) shards over dp_shard_mod_ep = 1 rank and has none to issue
        assert [calls for _, calls in out] == [2 * len(got)] * 4, (ep, out)


def _counting_job(rank, world_size, argv):
    """``(losses, reduce-scatters issued)`` of one example run."""
    import shardwise.composable._fsdp._reduce as reduce_mod

    calls, real = [0], reduce_mod.reduce_scatter_single

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    reduce_mod.reduce_scatter_single = counting
    try:
        return _main_job(rank, world_size, argv), calls[0]
    finally:
        reduce_mod.reduce_scatter_single = real


def test_moe_example_bad_flags():
    with pytest.raises(UsageError, match="--ep 3 must divide"):
        check_moe_args(8, 2, 3, 4, 1, 1)
    with pytest.raises(UsageError, match="needs experts"):
        check_moe_args(0, 2, 2, 4, 1, 1)
    with pytest.raises(UsageError, match="--top-k 9"):
        check_moe_args(8, 9, 1, 4, 1, 1)
    with pytest.raises(UsageError, match="--pp runs without --tp"):
        check_moe_args(8, 2, 2, 2, 2, 2)
    check_moe_args(8, 2, 2, 2, 1, 2)  # --pp with --ep runs
