"""The README's example models, compiled with backend="tpu", against eager PyTorch.

Metric: max |eager - compiled| relative to max |eager| (f32 everywhere here)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import gpt2  # noqa: E402
import mlp  # noqa: E402
import sd3  # noqa: E402


def relative_error(row: dict) -> float:
    return row["max_abs_diff"] / max(row["output_scale"], 1e-12)


def test_mlp_matches_eager():
    row = mlp.main()
    assert relative_error(row) <= 1e-5
    assert row["compiles"] == 1 and row["executions"] == 2


def test_gpt2_forward_and_generate_match_eager():
    row = gpt2.main()
    assert relative_error(row) <= 1e-4
    assert row["generate_matches_eager"]


def test_sd3_pipeline_matches_eager_and_reuses_executables(tmp_path):
    row = sd3.main(str(tmp_path / "sd3.png"))
    assert relative_error(row) <= 1e-3
    assert row["second_call_new_compiles"] == 0
    assert (tmp_path / "sd3.png").stat().st_size > 0
