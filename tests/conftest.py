"""Shared fixtures: a clean Dynamo and tpu_dynamo state per test, and a hermetic disk cache."""
import os
import tempfile

import pytest
import torch

import tpu_dynamo
from tpu_dynamo import _native

# Set before any test compiles (and inherited by subprocesses) so the suite never reads or
# writes a user's ~/.cache/tpu_dynamo, whatever their TPU_DYNAMO_CACHE* settings.
for _name in ("TPU_DYNAMO_CACHE", "TPU_DYNAMO_CACHE_MAX_BYTES", "TPU_DYNAMO_CACHE_SHARED"):
    os.environ.pop(_name, None)
_SESSION_CACHE = tempfile.TemporaryDirectory(prefix="tpu_dynamo_test_cache_")
os.environ["TPU_DYNAMO_CACHE_DIR"] = _SESSION_CACHE.name


@pytest.fixture(autouse=True)
def fresh_state(tmp_path_factory, monkeypatch):
    """Each test also gets its own cache directory (the process reopens the cache when the
    variable changes), so an executable one test wrote never turns another's compile into a
    disk hit."""
    monkeypatch.setenv("TPU_DYNAMO_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    torch._dynamo.reset()
    tpu_dynamo.reset_stats()
    yield
    torch._dynamo.reset()


@pytest.fixture
def compiled(monkeypatch):
    """`(graph JSON, CompiledGraph)` of every `_native.compile` call the test makes."""
    calls = []
    compile_now = _native.compile

    def recording(graph_json, **kwargs):
        calls.append((graph_json, compile_now(graph_json, **kwargs)))
        return calls[-1][1]

    monkeypatch.setattr(_native, "compile", recording)
    return calls


# The suite runs on the newest torch (CI) and, by scripts/test-torch.sh, on older releases (2.11
# and 2.13 checked); a test of what an older one cannot do for any backend is skipped there and
# says why.
TORCH_VERSION = torch.torch_version.TorchVersion(torch.__version__)


def dynamic_marks(t):
    """The dims Dynamo treats as symbolic when `t` comes back as an input (torch 2.15 renamed
    the attribute AOTAutograd's wrapper sets)."""
    return getattr(t, "_dynamo_propagated_dynamic_indices", None) or getattr(t, "_dynamo_weak_dynamic_indices", set())


def compile_tpu(fn, **kwargs):
    return torch.compile(fn, backend="tpu", fullgraph=True, **kwargs)


def backend_error(excinfo):
    """The backend's own exception inside Dynamo's BackendCompilerFailed wrapper."""
    return getattr(excinfo.value, "inner_exception", excinfo.value)
