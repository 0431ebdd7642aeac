"""Benchmark smoke test: seconds, no timing assertions. It fails only on gross errors: a
steady-state call that recompiles, an output that drifts from eager, a broken raw-execute timer."""
import sys
from pathlib import Path

import pytest
import torch

import tpu_dynamo

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import bench  # noqa: E402
import models  # noqa: E402


@pytest.mark.parametrize("name", ["micro", "gpt2-b1"])
def test_steady_state_calls_reuse_the_executable_and_match_eager(name):
    case = models.build(name, "cpu", torch.float32)
    with torch.no_grad():
        expected = bench._tensor(case.module(*case.inputs))
        call = bench._compiled(case, "tpu")
        call()
        compiles = tpu_dynamo.stats()["compiles"]
        outs = [bench._tensor(call()) for _ in range(5)]
        assert tpu_dynamo.stats()["compiles"] == compiles
        for out in outs:
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        (executable, args), = bench._recorded_executions(call)
        seconds = executable.bench_execute(args, 3)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
