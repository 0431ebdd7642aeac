"""Shared fixtures: a clean Dynamo and tpu_dynamo state per test."""
import pytest
import torch

import tpu_dynamo


@pytest.fixture(autouse=True)
def fresh_state():
    torch._dynamo.reset()
    tpu_dynamo.reset_stats()
    yield
    torch._dynamo.reset()


def compile_tpu(fn, **kwargs):
    return torch.compile(fn, backend="tpu", fullgraph=True, **kwargs)


def backend_error(excinfo):
    """The backend's own exception inside Dynamo's BackendCompilerFailed wrapper."""
    return getattr(excinfo.value, "inner_exception", excinfo.value)
