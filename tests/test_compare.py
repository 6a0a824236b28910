"""The suite's numeric folds cannot pass a NaN (tests/_compare.py): what Python's ``max`` lets
through (a NaN after the first element, or against a running worst) is an infinite error."""

from __future__ import annotations

import math

import pytest
import torch

from tests._compare import maxerr, rel_err, rel_errs

NAN, INF = math.nan, math.inf


def test_python_max_skips_a_nan_and_maxerr_does_not():
    assert max([0.1, NAN]) == 0.1 and max(0.0, NAN) == 0.0  # the trap
    assert maxerr([0.1, NAN]) == INF and maxerr(0.0, NAN) == INF and maxerr(NAN, 0.0) == INF
    assert maxerr([0.1, 0.3, 0.2]) == 0.3 and maxerr(torch.tensor(0.5)) == 0.5
    with pytest.raises(ValueError, match="nothing was compared"):
        maxerr([])


def test_losses_with_a_nan_after_the_first_step_fail():
    # the case a mutation run found: fsdp_post_all_gather(out=) skipped, losses [1.33, nan, nan, nan]
    got, want = [1.33, NAN, NAN, NAN], [1.33, 1.2, 1.1, 1.0]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) == 0.0  # what the old helper saw
    assert rel_errs(got, want) == INF and not rel_errs(got, want) <= 1e-6
    assert rel_errs([1.0, INF], [1.0, INF]) == INF and rel_errs([1.0], [1.0, 2.0]) == INF
    assert rel_errs([1.0, 2.0 + 2e-7], [1.0, 2.0]) < 1e-6


def test_tensor_relative_error_is_infinite_on_a_non_finite_value():
    b = torch.tensor([1.0, 2.0])
    assert rel_err(b + 1e-7, b) < 1e-6
    for bad in (torch.tensor([1.0, NAN]), torch.tensor([INF, 2.0])):
        assert rel_err(bad, b) == INF and rel_err(b, bad) == INF
