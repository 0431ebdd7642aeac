"""Dynamo's caching precompile for backend="tpu": a new process neither traces nor compiles.

With `torch._dynamo.config.caching_precompile = True` (or `TORCH_CACHING_PRECOMPILE=1`) Dynamo
keeps each compiled frame (bytecode and guards), and `torch.compiler.save_cache_artifacts()`
writes it to Dynamo's disk cache together with one artifact per backend call. A later process
with the same setting loads the frame when the function is compiled and calls the artifacts
instead of tracing. Ours is the converted graph: loading it finds the executable in our disk
cache, so the first call only checks guards, loads and runs.

Stored are the graphs whose AOTAutograd runtime wrapper has nothing to do but call the
executable: static shapes, every input a plain Dynamo input, no output that aliases an input or
an intermediate, input mutations all inside the graph, no effect tokens. For any other graph no
artifact is recorded, so Dynamo stores no entry for its frame and traces it as before.
"""
from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import torch
import torch.fx
from torch._dynamo.precompile_context import BackendCacheArtifact, PrecompileContext
from torch._functorch._aot_autograd.descriptors import PlainAOTInput
from torch._functorch._aot_autograd.schemas import MutationType, OutputType

from . import _native
from .convert import Converted
from .executable import Executable


def record(backend_id: str | None, aten_gm: torch.fx.GraphModule, converted: Converted) -> None:
    """Records `converted` as the artifact of Dynamo's backend call `backend_id` (set on the
    graph Dynamo hands the backend only under caching precompile) when the call needs no
    AOTAutograd runtime wrapper."""
    if backend_id is None or not _wrapper_free(aten_gm):
        return
    PrecompileContext.record_artifact(TpuArtifact(key=backend_id, content=pickle.dumps(converted)))


def _wrapper_free(aten_gm: torch.fx.GraphModule) -> bool:
    meta = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
    if meta is None or meta.tokens or meta.num_intermediate_bases:
        return False
    placeholders = aten_gm.graph.find_nodes(op="placeholder")
    return (
        all(
            isinstance(desc := n.meta.get("desc"), PlainAOTInput) and desc.idx == i
            for i, n in enumerate(placeholders)
        )
        and all(o.output_type == OutputType.non_alias for o in meta.output_info)
        and all(
            i.mutation_type in (MutationType.NOT_MUTATED, MutationType.MUTATED_IN_GRAPH)
            and not i.mutates_metadata
            for i in meta.input_info
        )
    )


@dataclasses.dataclass
class TpuArtifact(BackendCacheArtifact[Any]):
    """A converted graph; deserialized, it is the callable Dynamo's bytecode calls."""

    def after_deserialization(self) -> Any:
        converted: Converted = pickle.loads(self.content)
        # Nothing wraps it, so it bumps the version of every input it updates itself.
        return _Unboxed(Executable(_native.compile(converted.json), converted))


class _Unboxed:
    """Dynamo's bytecode calls the backend's result with the graph's inputs as arguments."""

    def __init__(self, executable: Executable) -> None:
        self.executable = executable

    def __call__(self, *args: Any) -> tuple[torch.Tensor | None, ...]:
        return self.executable(list(args))
