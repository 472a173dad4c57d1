from __future__ import annotations

import pytest

from pdserve.shared.transfer import create_transfer, merge_runs
from pdserve.shared.transfer import base


def test_merge_runs_groups_pages_consecutive_on_both_sides():
    assert merge_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]


def test_merge_runs_breaks_on_a_gap_in_either_list():
    assert merge_runs([0, 1, 2, 3], [10, 11, 20, 21]) == [(0, 10, 2), (2, 20, 2)]
    assert merge_runs([0, 1, 5, 6], [10, 11, 12, 13]) == [(0, 10, 2), (5, 12, 2)]


def test_merge_runs_keeps_order_and_never_merges_descending_or_repeated_pages():
    assert merge_runs([3, 2, 1], [3, 2, 1]) == [(3, 3, 1), (2, 2, 1), (1, 1, 1)]
    assert merge_runs([7, 7], [1, 2]) == [(7, 1, 1), (7, 2, 1)]
    assert merge_runs([5], [9]) == [(5, 9, 1)]
    assert merge_runs([], []) == []


def test_merge_runs_one_run_for_a_whole_prompt():
    pages = list(range(100, 228))
    assert merge_runs(pages, list(range(128))) == [(100, 0, 128)]


def test_merge_runs_rejects_lists_of_different_length():
    with pytest.raises(ValueError, match="3 source pages but 2"):
        merge_runs([1, 2, 3], [1, 2])


def test_unknown_backend_is_named_and_missing_nixl_says_how_to_install(monkeypatch):
    import torch

    pool = torch.zeros(4, 16)
    with pytest.raises(ValueError, match="unknown transfer backend 'rdma'"):
        create_transfer("rdma", "x", pool)
    monkeypatch.setitem(base._BACKENDS, "nixl", ("pdserve_no_such_module", "NixlTransfer", "pip install nixl-cu12"))
    with pytest.raises(ImportError, match="pip install nixl-cu12"):
        create_transfer("nixl", "x", pool)


def test_non_contiguous_pool_is_refused():
    import torch

    with pytest.raises(ValueError, match="contiguous"):
        create_transfer("tcp", "x", torch.zeros(16, 4).t())
