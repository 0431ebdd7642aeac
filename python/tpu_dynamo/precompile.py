"""Dynamo's caching precompile for backend="tpu": a new process neither traces nor compiles.

With `torch._dynamo.config.caching_precompile = True` (or `TORCH_CACHING_PRECOMPILE=1`) Dynamo
keeps each compiled frame (bytecode and guards), and `torch.compiler.save_cache_artifacts()`
writes it to Dynamo's disk cache together with one artifact per backend call. A later process
with the same setting loads the frame when the function is compiled and calls the artifacts
instead of tracing. Ours is the converted graph: loading it finds the executable in our disk
cache, so the first call only checks guards, loads and runs.

Stored are the graphs the backend already calls without AOTAutograd's runtime wrapper
(`direct.wrapper_free`): nothing of AOTAutograd is needed to call them again. For any other
graph no artifact is recorded, so Dynamo stores no entry for its frame and traces it as before.
Nor for a frame Dynamo could not load again (`_reloadable`).
"""
from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import torch
from torch._dynamo.precompile_context import BackendCacheArtifact, PrecompileContext
from torch._dynamo.symbolic_convert import InstructionTranslator

from . import _native
from .convert import Converted
from .direct import Direct


def record(backend_id: str | None, converted: Converted) -> None:
    """Records `converted`, a graph called without AOTAutograd's wrapper (direct.py), as the
    artifact of Dynamo's backend call `backend_id` (set on the graph Dynamo hands the backend
    only under caching precompile)."""
    if backend_id is None or not _reloadable():
        return
    PrecompileContext.record_artifact(TpuArtifact(key=backend_id, content=pickle.dumps(converted)))


def _reloadable() -> bool:
    """Whether Dynamo can reattach the frame being compiled in a later process. It installs the
    saved graph into the module named by the function's `__module__`, while the frame's code
    reads the globals it was defined with; a wrapper made with `functools.wraps` in another module
    (transformers' `deprecate_kwarg` and `can_return_tuple`, diffusers' decorators wrap model
    forwards so) has the wrapped function's `__module__`, and its saved frame fails to load with
    a `NameError` (also with backend="inductor"). Such a frame is traced again instead."""
    tx = InstructionTranslator.current_tx()
    fn = getattr(getattr(tx, "package", None), "_innermost_fn", None)
    scope = getattr(fn, "__globals__", {}).get("__name__")
    return fn is None or scope is None or fn.__module__ == scope


@dataclasses.dataclass
class TpuArtifact(BackendCacheArtifact[Any]):
    """A converted graph; deserialized, it is the callable Dynamo's bytecode calls."""

    def after_deserialization(self) -> Any:
        converted: Converted = pickle.loads(self.content)
        return Direct(_native.compile(converted.json), converted)
