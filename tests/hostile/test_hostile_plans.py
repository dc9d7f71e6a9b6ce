"""Plans a job reads back (Falcon's restart grid, the S4 plan of a relaunched job): anything but what a
job of ours writes is refused in one line naming the file, before any process group."""

from __future__ import annotations

import json

import pytest

from titan_ext.runtime.falcon.restart import _PLAN_FILE, read_restart_plan


@pytest.mark.parametrize("grid, why", [
    ([[0, 1], [1, 3]], "each rank 0..3 once"),        # a rank twice, one missing
    ([[0, 1], [2, 4]], "each rank 0..3 once"),        # a rank beyond the world
    ([[0, 1], [2, "3"]], "each rank 0..3 once"),      # not an int
    ([[0, 1], [2, True]], "each rank 0..3 once"),     # a bool is no rank
    ([[0, 1, 2], [3]], "is not 2x2"),
    ([[0, 1]], "is not 2x2"),
    ("0123", "is not 2x2"),
])
def test_a_restart_grid_that_is_not_a_permutation_is_refused(tmp_path, grid, why):
    (tmp_path / _PLAN_FILE).write_text(json.dumps({"grid": grid}))
    with pytest.raises(ValueError, match=why) as e:
        read_restart_plan(tmp_path, 2, 2)
    assert str(tmp_path / _PLAN_FILE) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["{", "[]", "{}", '{"grid": null}'])
def test_a_restart_plan_without_a_grid_is_refused(tmp_path, text):
    (tmp_path / _PLAN_FILE).write_text(text)
    with pytest.raises(ValueError, match="restart plan"):
        read_restart_plan(tmp_path, 2, 2)


def test_a_permuted_grid_is_read_and_no_plan_is_the_identity(tmp_path):
    assert read_restart_plan(tmp_path, 2, 2) == [[0, 1], [2, 3]]
    (tmp_path / _PLAN_FILE).write_text(json.dumps({"grid": [[3, 1], [2, 0]]}))
    assert read_restart_plan(tmp_path, 2, 2) == [[3, 1], [2, 0]]
