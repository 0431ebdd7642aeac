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
        (executable, args, sizes), = bench.recorded_executions(call)
        seconds = executable.bench_execute(args, 3, *sizes)
        calls = bench.inside_and_whole(call, 3)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    # Of the same calls (two passes' medians differ by this VM's noise alone).
    assert all(0 < inside < whole for inside, whole in calls), "the time inside our executables is part of the call"


def test_a_decode_times_the_bare_execute_of_every_step_padded_ones_included():
    case = models.build("llama-decode", "cpu", torch.float32)
    with torch.no_grad():
        call = bench._compiled(case, "tpu")
        call()
        steps = bench.recorded_executions(call)
        seconds = [s for exe, args, sizes in steps for s in exe.bench_execute(args, 2, *sizes)]
        inside = bench.inside_ms(call, 2)
    assert any(sizes and sizes[0].given for _, _, sizes in steps), "the dynamic-cache decode pads its steps"
    assert len(seconds) == 2 * len(steps) and all(s > 0 for s in seconds)
    assert inside > 0


def test_the_table_has_a_cell_for_every_column():
    row = {"model": "m", "decode": False, "eager_ms": 2.0, "inductor_ms": 1.0, "tpu_ms": 1.5, "inside_ms": 1.2,
           "raw_ms": 1.0, "max_abs_diff": 1e-7, "recompiles": 0}
    colds = {("m", k): 1.0 for k in ("inductor", "tpu", "tpu-warm", "tpu-precompile", "tpu-precompiled")}
    lines = bench.table([row, {"model": "n", "error": "boom"}], colds).splitlines()
    assert len({line.count("|") for line in lines}) == 1, lines


def test_warm_first_calls_are_divided_by_our_cold_first_call():
    row = {"model": "m", "decode": False, "eager_ms": 2.0, "inductor_ms": 1.0, "tpu_ms": 1.5, "inside_ms": 1.2,
           "raw_ms": 1.0, "max_abs_diff": 1e-7, "recompiles": 0}
    # The precompile-saving process runs on the executables the cold one stored: a warm call.
    colds = {("m", "inductor"): 20.0, ("m", "tpu"): 4.0, ("m", "tpu-warm"): 2.0, ("m", "tpu-precompile"): 2.5,
             ("m", "tpu-precompiled"): 0.2}
    head, _, line = bench.table([row], colds).splitlines()
    cells = dict(zip((c.strip() for c in head.split("|")), (c.strip() for c in line.split("|"))))
    assert (cells["warm/cold"], cells["precompiled/cold"]) == ("0.50", "0.05"), cells


@pytest.mark.parametrize("table", ["gpt2_ops", "sd15_convs"])
def test_the_op_table_times_each_op_both_ways(table, capsys):
    """Each table's first three ops (the VAE's convolutions take ~0.4 s a call)."""
    import ops

    some = dict(list(getattr(ops, table)().items())[:3])
    with torch.no_grad():
        ops.run_ops(some, 3)
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()[2:]]
    assert len(rows) == len(some)
    assert all(float(eager) > 0 and float(ours) > 0 for _, eager, ours, _ in rows), rows
