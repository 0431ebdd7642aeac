"""Fast OpInfo conformance subset: the first sample of each census op (the ops the model zoo
produces), through the same classification as `make conformance`; ours must pass."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "conformance"))
import run  # noqa: E402

CENSUS_OPS = [
    "add", "sub", "mul", "div.no_rounding_mode", "div.floor_rounding", "true_divide", "neg", "abs",
    "exp", "log", "sin", "cos", "tanh", "sigmoid", "rsqrt", "sqrt", "reciprocal", "pow", "minimum",
    "clamp", "where", "eq", "ne", "gt", "ge", "lt", "le", "logical_not", "logical_and", "bitwise_and",
    "any", "sum", "mean", "cumsum", "softmax", "log_softmax", "mm", "bmm", "addmm", "sort", "topk",
    "histc", "cat", "expand", "permute", "view", "unsqueeze", "squeeze", "repeat", "split_with_sizes",
    "gather", "index_put", "scatter", "view_as_real", "view_as_complex", "nn.functional.gelu",
    "nn.functional.relu", "nn.functional.embedding", "nn.functional.layer_norm",
    "nn.functional.group_norm", "nn.functional.conv2d", "constant_pad_nd", "full_like",
]
OPS = {run.op_key(op): op for op in run.op_list()}


@pytest.mark.parametrize("name", CENSUS_OPS)
def test_census_op_conforms(name):
    op = OPS[name]
    sample = next(iter(op.sample_inputs("cpu", torch.float32, requires_grad=False)))
    with torch.no_grad():
        status, reason = run.run_sample(op, sample, run.tolerance(op))
    assert status not in run.OURS, f"{name}: {status}: {reason}"
