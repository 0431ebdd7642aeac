"""Graphs called straight from Dynamo's bytecode, without AOTAutograd's runtime wrapper.

AOTAutograd wraps every compiled graph in Python that dedupes inputs, replays input mutations
and metadata changes, regenerates outputs that alias inputs or intermediates, threads effect
tokens and runs the graph under the right grad mode: about a dozen frames per call. An inference
graph with none of these needs (`wrapper_free`) gets none of that work from it, only its cost,
so the backend hands Dynamo the executable itself (`Direct`), or for a graph with symbolic
sizes its per-shape dispatcher. Dynamo's caching precompile stores these graphs (precompile.py),
and so does the disk cache by their Dynamo graph (graph_cache.py); found again, either kind is
called the same way (`found`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch._functorch._aot_autograd.descriptors import PlainAOTInput
from torch._functorch._aot_autograd.schemas import MutationType, OutputType

from . import _native
from .convert import Converted
from .executable import Executable
from .options import Options
from .symbolic import PerShape, Traced


def wrapper_free(aten_gm: torch.fx.GraphModule, dynamo_inputs: int) -> bool:
    """Whether AOTAutograd's runtime wrapper for `aten_gm` (being compiled now, for a Dynamo
    graph of `dynamo_inputs` inputs) would only call it: the Dynamo inputs themselves in order,
    no output that is a view of an input or aliases an intermediate (one that is an input itself,
    `returned_inputs`, the caller returns), input mutations all inside the graph, no effect
    tokens, no RNG state threading, no grad-mode change to replay. (Its remaining acts: running
    the graph with grad mode off, which does not concern an executable that records no autograd
    history, and marking outputs' symbolic dims for Dynamo, which `Direct` does.)"""
    meta = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
    if (
        meta is None
        or meta.tokens
        or meta.num_intermediate_bases
        or meta.is_rng_op_functionalized
        or meta.num_graphsafe_rng_states
        or meta.grad_enabled_mutation is not None
    ):
        return False
    placeholders = aten_gm.graph.find_nodes(op="placeholder")
    return (
        len(placeholders) == dynamo_inputs
        and all(
            isinstance(desc := n.meta.get("desc"), PlainAOTInput) and desc.idx == i
            for i, n in enumerate(placeholders)
        )
        and all(o.output_type in (OutputType.non_alias, OutputType.is_input) for o in meta.output_info)
        and all(
            i.mutation_type in (MutationType.NOT_MUTATED, MutationType.MUTATED_IN_GRAPH)
            and not i.mutates_metadata
            for i in meta.input_info
        )
    )


def returned_inputs() -> tuple[tuple[int, int], ...]:
    """`(output, input)` for each output of the graph `wrapper_free` approved that is one of
    its inputs."""
    meta = torch._guards.TracingContext.get().fw_metadata
    return tuple((o, info.base_idx) for o, info in enumerate(meta.output_info) if info.output_type == OutputType.is_input)


def with_returned_inputs(converted: Converted) -> Converted:
    """`converted` (of the graph `wrapper_free` approved) with the outputs that are its inputs."""
    return dataclasses.replace(converted, returned_inputs=returned_inputs())


def dynamic_dims() -> tuple[tuple[int, set[int]], ...]:
    """`(output, dims)` for each output of the graph `wrapper_free` approved whose sizes along
    `dims` are symbolic: Dynamo reads them off the tensor when the output is traced again (a
    dynamic cache's K/V in the next step), to keep those dims symbolic rather than recompile."""
    meta = torch._guards.TracingContext.get().fw_metadata
    return tuple((o, info.dynamic_dims) for o, info in enumerate(meta.output_info) if info.dynamic_dims)


class Direct:
    """What Dynamo's bytecode calls, with the graph's inputs as arguments. Nothing wraps it, so
    its executables bump the version of every input they update themselves."""

    def __init__(
        self,
        run: Callable[[list[Any]], tuple[Any, ...]],
        returned: tuple[tuple[int, int], ...] = (),
        dynamic: tuple[tuple[int, set[int]], ...] = (),
    ) -> None:
        """`run`: the graph's call on a list of its inputs (an `Executable`, or a symbolic
        graph's `PerShape`); `returned`, `dynamic`: see `returned_inputs`, `dynamic_dims`."""
        # Imported here: at this module's import, before Dynamo's, it would be a circular import.
        from torch._functorch._aot_autograd import runtime_wrappers

        self.run, self.returned_inputs, self.dynamic_dims = run, returned, dynamic
        # The wrapper's own helper, so the marks are the ones this torch's Dynamo reads (torch
        # 2.15 renamed it and its attribute).
        self.mark_dynamic = getattr(runtime_wrappers, "mark_dynamo_propagated_dynamic_indices", None) or (
            runtime_wrappers.maybe_mark_dynamic_helper
        )

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        outs = self.run(list(args))
        if self.returned_inputs:
            returned = list(outs)
            for o, i in self.returned_inputs:
                returned[o] = args[i]
            outs = tuple(returned)
        for o, dims in self.dynamic_dims:
            self.mark_dynamic(outs[o], dims)
        return outs


def found(graph: Converted | Traced, options: Options | None = None) -> Direct:
    """The call of a graph an earlier process stored (graph_cache.py, precompile.py); `options`:
    this process's."""
    if isinstance(graph, Traced):
        assert graph.converted is not None  # stored only with the IR's graph
        return Direct(PerShape(graph, options=options), graph.converted.returned_inputs, graph.dynamic)
    return Loading(graph)


class Loading(Direct):
    """A graph converted in an earlier process (a precompiled frame's, or one found by its
    Dynamo graph: graph_cache.py) while its executable is found (on disk, normally) and run once
    on zeros on another thread (`_native.compile_in_background`), which overlaps Dynamo building
    the frame's guards and code: for the UNet of `make bench` those take ~0.4 s, the load ~0.15 s
    and a first execute ~0.15 s more than a later one. The first call waits for it and turns
    this object into the plain `Direct` it calls from then on."""

    def __init__(self, converted: Converted) -> None:
        self.loading = _native.compile_in_background(converted.json)
        self.converted = converted

    def __call__(self, *args: Any) -> tuple[torch.Tensor | None, ...]:
        Direct.__init__(self, Executable(self.loading.result(), self.converted), self.converted.returned_inputs)
        del self.loading, self.converted
        self.__class__ = Direct
        return Direct.__call__(self, *args)
