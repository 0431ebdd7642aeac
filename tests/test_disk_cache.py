"""The persistent executable cache (issue #5): warm starts across processes, damaged entries,
keys, modes and the `python -m tpu_dynamo cache` CLI."""
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tpu_dynamo

from conftest import compile_tpu

ROOT = Path(__file__).resolve().parent.parent
WARM_START = ROOT / "bench" / "cache_warm_start.py"


def cache_dir() -> Path:
    return Path(os.environ["TPU_DYNAMO_CACHE_DIR"])


def entries() -> list[str]:
    return sorted(p.name for p in cache_dir().glob("*.tpuexe"))


def run_fresh(x: torch.Tensor) -> torch.Tensor:
    """One compiled call as a new process would make it: no Dynamo or in-memory state."""
    torch._dynamo.reset()
    tpu_dynamo.reset_stats()
    with torch.no_grad():
        return compile_tpu(lambda t: torch.tanh(t @ t.T + 1.0))(x)


def expected(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ x.T + 1.0)


@pytest.mark.parametrize("model", ["gpt2", "sd3"])
def test_second_process_loads_from_disk_without_compiling(model, tmp_path):
    env = {**os.environ, "TPU_DYNAMO_CACHE_DIR": str(tmp_path / "cache")}

    def process(out: str) -> dict:
        subprocess.run([sys.executable, str(WARM_START), "--child", model, str(tmp_path / out)],
                       env=env, check=True, capture_output=True)
        return torch.load(tmp_path / out)

    cold = process("cold.pt")
    written = sorted(p.name for p in (tmp_path / "cache").iterdir())
    warm = process("warm.pt")
    assert cold["stats"]["compiles"] >= 1
    assert cold["stats"]["disk_writes"] == cold["stats"]["compiles"]
    assert warm["stats"]["compiles"] == 0
    assert warm["stats"]["disk_hits"] == cold["stats"]["compiles"]
    assert warm["stats"]["disk_writes"] == 0
    # Nor traced by AOTAutograd nor converted: its converted graphs were found by Dynamo's.
    assert warm["stats"]["graph_hits"] == cold["stats"]["graph_writes"] >= 1
    assert torch.equal(warm["output"], cold["output"])
    # The second process computed the same keys: it read the first one's files, added none.
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == written


def test_compiler_flags_from_the_environment_are_part_of_the_key(tmp_path):
    """XLA_FLAGS changes the code XLA generates, so a process with other flags compiles anew."""
    script = (
        "import torch, tpu_dynamo\n"
        "f = torch.compile(lambda t: torch.tanh(t @ t.T + 1.0), backend='tpu', fullgraph=True)\n"
        "f(torch.randn(4, 4))\n"
        "s = tpu_dynamo.stats(); print(s['compiles'], s['disk_hits'])\n"
    )

    def process(flags: str) -> str:
        env = {**os.environ, "TPU_DYNAMO_CACHE_DIR": str(tmp_path), "XLA_FLAGS": flags}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        return done.stdout.split("\n")[-2]

    assert process("") == "1 0"
    assert process("--xla_cpu_enable_fast_math=false") == "1 0"
    assert process("--xla_cpu_enable_fast_math=false") == "0 1"
    assert process("") == "0 1"


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda b: b[: len(b) // 2], "checksum mismatch"),
        (lambda b: b[:20], "truncated"),
        (lambda b: b[:100] + bytes([b[100] ^ 0xFF]) + b[101:], "checksum mismatch"),
        (lambda b: b"not an entry at all" * 4, "bad magic"),
    ],
    ids=["half", "header-only", "bit-flip", "foreign"],
)
def test_damaged_entry_is_logged_removed_and_recompiled(damage, reason, caplog):
    x = torch.randn(4, 8)
    run_fresh(x)
    (name,) = entries()
    path = cache_dir() / name
    path.write_bytes(damage(path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="tpu_dynamo"):
        torch.testing.assert_close(run_fresh(x), expected(x))
    s = tpu_dynamo.stats()
    assert (s["compiles"], s["disk_hits"], s["disk_rejects"], s["disk_writes"]) == (1, 0, 1, 1)
    (record,) = [r for r in caplog.records if r.name == "tpu_dynamo" and r.levelno == logging.WARNING]
    assert name in record.getMessage() and reason in record.getMessage()
    run_fresh(x)  # the rewritten entry is good again
    assert (tpu_dynamo.stats()["compiles"], tpu_dynamo.stats()["disk_hits"]) == (0, 1)


def test_entry_under_another_key_is_rejected(caplog):
    x, y = torch.randn(4, 8), torch.randn(5, 8)
    run_fresh(x)
    (first,) = entries()
    run_fresh(y)
    (second,) = set(entries()) - {first}
    (cache_dir() / second).write_bytes((cache_dir() / first).read_bytes())
    with caplog.at_level(logging.WARNING, logger="tpu_dynamo"):
        torch.testing.assert_close(run_fresh(y), expected(y))
    assert tpu_dynamo.stats()["disk_rejects"] == 1
    assert any("different key" in r.getMessage() for r in caplog.records)


def test_key_is_stable_and_changes_with_shape_and_dtype():
    x = torch.randn(4, 8)
    run_fresh(x)
    (name,) = entries()
    run_fresh(x.clone())
    assert entries() == [name] and tpu_dynamo.stats()["disk_hits"] == 1
    run_fresh(torch.randn(5, 8))
    run_fresh(x.double())
    assert len(entries()) == 3 and name in entries()


def test_disk_hit_lowers_only_when_stablehlo_is_wanted(tmp_path, monkeypatch):
    x = torch.randn(3, 8)
    run_fresh(x)
    run_fresh(x)
    assert tpu_dynamo.stats()["lower_seconds"] == 0.0  # a plain disk hit skips lowering
    monkeypatch.setenv("TPU_DYNAMO_DUMP_DIR", str(tmp_path / "dump"))
    run_fresh(x)
    s = tpu_dynamo.stats()
    assert (s["compiles"], s["disk_hits"]) == (0, 1) and s["lower_seconds"] > 0
    (mlir,) = (tmp_path / "dump").glob("*.stablehlo.mlir")
    assert "stablehlo" in mlir.read_text()


def test_cache_off_writes_nothing(monkeypatch):
    monkeypatch.setenv("TPU_DYNAMO_CACHE", "0")
    run_fresh(torch.randn(4, 8))
    run_fresh(torch.randn(4, 8))
    s = tpu_dynamo.stats()
    assert (s["compiles"], s["disk_hits"], s["disk_misses"], s["disk_writes"]) == (1, 0, 0, 0)
    assert not cache_dir().exists() or entries() == []


def test_readonly_reads_but_writes_nothing(monkeypatch):
    x = torch.randn(4, 8)
    run_fresh(x)
    before = {p: p.stat().st_mtime_ns for p in cache_dir().iterdir()}
    monkeypatch.setenv("TPU_DYNAMO_CACHE", "readonly")
    run_fresh(x)
    run_fresh(torch.randn(6, 8))
    s = tpu_dynamo.stats()
    assert (s["compiles"], s["disk_hits"], s["disk_writes"]) == (1, 0, 0)
    assert {p: p.stat().st_mtime_ns for p in cache_dir().iterdir()} == before
    assert tpu_dynamo.cache_info()["mode"] == "readonly"


def test_unusable_directory_degrades_to_memory_with_one_warning(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    # A path under a regular file: unusable even for root, who ignores permission bits.
    monkeypatch.setenv("TPU_DYNAMO_CACHE_DIR", str(blocker / "cache"))
    with caplog.at_level(logging.WARNING, logger="tpu_dynamo"):
        for n in (4, 5, 6):
            torch.testing.assert_close(run_fresh(torch.ones(n, 8)), expected(torch.ones(n, 8)))
    warnings = [r for r in caplog.records if r.name == "tpu_dynamo" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cached in memory only" in warnings[0].getMessage()
    assert tpu_dynamo.stats()["compiles"] == 1  # counters reset per run_fresh; each compiled


def cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tpu_dynamo", *args], capture_output=True, text=True,
                          check=True)
    return done.stdout


def test_cli_cache_info_list_clear_and_doctor():
    run_fresh(torch.randn(4, 8))
    run_fresh(torch.randn(5, 8))
    keys = [name.split(".")[0] for name in entries()]
    info = cli("cache", "info")
    assert str(cache_dir()) in info and "entries: 2 " in info and "readwrite" in info
    assert "graphs:  2 converted graphs" in info  # each one's, found by its Dynamo graph
    assert "plugin:" in info and "cpu" in info
    listed = cli("cache", "list")
    assert sorted(line.split()[0] for line in listed.splitlines()) == sorted(k[:16] for k in keys)
    assert "removed 4 entries" in cli("cache", "clear")
    info = cli("cache", "info")
    assert entries() == [] and "entries: 0 " in info and "graphs:  0 " in info
    doctor = cli("doctor")
    assert f"MLIR {tpu_dynamo._native.MLIR_VERSION}" in doctor and "MLIR 22." in doctor
    for needed in ("torch:", "transformers:", "diffusers:", "plugin:", "devices:", "host kernels:", "cache dir:"):
        assert needed in doctor
