"""The Dynamo backend: `torch.compile(m, backend="tpu")`.

Registered through the `torch_dynamo_backends` entry points (`tpu`, `tpu_dynamo`), never by
`register_backend`: TorchTPU registers "tpu" on import and Dynamo asserts on duplicates, so an
entry point (looked up only when the name is not registered yet) is the only collision-free way.
"""
from __future__ import annotations

import dataclasses
import functools

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch._decomp import core_aten_decompositions, decomposition_table
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch._aot_autograd.descriptors import BufferAOTInput, ParamAOTInput, PlainAOTInput

from . import _native, debug, direct, graph_cache, precompile
from . import options as options_mod
from .convert import InputKind
from .executable import compile_graph
from .symbolic import PerShape, Traced


# Core ATen ops lowered as themselves when the compiler has a rule: core's decomposition of `take`
# reads a 0-d index with `.item()`, a data-dependent scalar that static shapes cannot bind;
# CPU SDPA's (`_scaled_dot_product_flash_attention_for_cpu`) normalizes the whole probability
# matrix before multiplying by V, where the rule divides the product; `_safe_softmax` (the math
# path's softmax) decomposes into two extra passes over the scores to find fully masked rows,
# which the rule reads off the row sums.
_KEEP = {
    torch.ops.aten.take.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._safe_softmax.default,
}


def _attention(query, key, value, attn_mask, dropout_p, is_causal, scale):  # type: ignore[no-untyped-def]
    """The CPU's fused attention op, which the compiler lowers as one unit, in place of a GPU's."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )


def _with_kernel_state(out, lse, query, key):  # type: ignore[no-untyped-def]
    """Flash and cuDNN attention's results: beside the output and logsumexp, what the kernel keeps
    for backward and dropout (empty here) and the longest query and key lengths."""
    none = query.new_empty(0, dtype=torch.int64)
    return out, lse, none, none, query.shape[2], key.shape[2], none, none, none


def _flash_attention(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):  # type: ignore[no-untyped-def]
    return _with_kernel_state(*_attention(query, key, value, None, dropout_p, is_causal, scale), query, key)


def _cudnn_attention(  # type: ignore[no-untyped-def]
    query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
    scale=None,
):
    return _with_kernel_state(*_attention(query, key, value, attn_bias, dropout_p, is_causal, scale), query, key)


def _efficient_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):  # type: ignore[no-untyped-def]
    out, lse = _attention(query, key, value, attn_bias, dropout_p, is_causal, scale)
    none = query.new_empty(0, dtype=torch.int64)  # the dropout's seed and offset
    return out, lse, none, none


# On CUDA tensors SDPA dispatches to a GPU kernel (flash, cuDNN, memory-efficient), which has no
# decomposition: each becomes the CPU's fused op, the same attention, which the compiler lowers.
_GPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention.default: _flash_attention,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default: _cudnn_attention,
    torch.ops.aten._scaled_dot_product_efficient_attention.default: _efficient_attention,
}


@functools.cache
def decompositions() -> dict[Any, Callable[..., Any]]:
    """Core ATen (the compiler lowers core ATen ops, plus what the census shows survives it, e.g.
    SDPA is decomposed by this table into bmm/_softmax), and beyond it PyTorch's decomposition
    of every op the compiler has no rule for, so an op without a rule still compiles when it
    reduces to ops with one. Built on the first compile (~0.2 s), not at import: a process that
    only loads precompiled graphs never needs it."""
    ours = set(_native.supported_ops())
    table = {op: fn for op, fn in core_aten_decompositions().items() if op not in _KEEP or str(op) not in ours}
    for op, fn in decomposition_table.items():
        if op not in table and isinstance(op, torch._ops.OpOverload) and str(op) not in ours:
            table[op] = fn
    return {**table, **_GPU_ATTENTION}


def _dynamo_kind(node: torch.fx.Node, value: Any) -> InputKind:
    """Parameter/buffer/constant for the module state Dynamo lifted to inputs, else user.

    With `inline_inbuilt_nn_modules` Dynamo passes parameters and buffers as graph inputs; their
    source chain goes through `_parameters[...]` / `_buffers[...]`. Other tensors Dynamo treats
    as static (plain tensor attributes, `mark_static_address`) are constants.
    """
    if isinstance(value, torch.nn.Parameter):
        return InputKind.PARAMETER
    source = getattr(node, "_dynamo_source", None)
    while source is not None:
        member = getattr(source, "member", None)
        if member == "_buffers":
            return InputKind.BUFFER
        if member == "_parameters":
            return InputKind.PARAMETER
        source = getattr(source, "base", None)
    if node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"):
        return InputKind.CONSTANT
    return InputKind.USER


def _aot_kinds(gm: torch.fx.GraphModule, dynamo_kinds: list[InputKind]) -> list[InputKind]:
    """Maps AOTAutograd's placeholders (described by `meta["desc"]`) back to input kinds."""
    kinds = []
    for n in gm.graph.find_nodes(op="placeholder"):
        desc = n.meta.get("desc")
        if isinstance(desc, ParamAOTInput):
            kinds.append(InputKind.PARAMETER)
        elif isinstance(desc, BufferAOTInput):
            kinds.append(InputKind.BUFFER)
        elif isinstance(desc, PlainAOTInput):
            kinds.append(dynamo_kinds[desc.idx])
        else:
            kinds.append(InputKind.USER)
    return kinds


def _check_inference(example_inputs: Sequence[Any]) -> None:
    if torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
    ):
        raise NotImplementedError(
            "tpu_dynamo: training (autograd through the compiled graph) is not supported yet;"
            " run the model under torch.no_grad() or torch.inference_mode()"
        )


def _is_symbolic(example_inputs: Sequence[Any]) -> bool:
    return any(
        isinstance(x, torch.SymInt)
        or (isinstance(x, torch.Tensor) and any(not isinstance(d, int) for d in x.shape))
        for x in example_inputs
    )


def _versions_bumped_by_aot() -> frozenset[int]:
    """Inputs whose version AOTAutograd's runtime wrapper bumps after the graph mutated them."""
    meta = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
    return frozenset(meta.mutated_graph_handled_indices_seen_by_autograd) if meta else frozenset()


def _aot_compile(
    gm: torch.fx.GraphModule, args: Sequence[Any], dynamo_kinds: list[InputKind], opts: options_mod.Options
) -> Callable[..., Any]:
    symbolic = _is_symbolic(args)
    shape_facts = graph_cache.shape_facts()
    graph_key = graph_cache.key(gm, args, dynamo_kinds, opts, shape_facts)
    if graph_key is not None and (stored := graph_cache.load(graph_key)) is not None:
        debug.log.info("%s: found its converted graph in the disk cache", opts.name or "graph")
        precompile.record(getattr(gm, "_backend_id", None), stored)
        return direct.found(stored, opts)
    unwrapped: list[direct.Direct] = []

    def compiler(aten_gm: torch.fx.GraphModule, _inputs: Sequence[Any]) -> Callable[..., Any]:
        free = direct.wrapper_free(aten_gm, len(args))
        # Called directly, a graph bumps the versions AOTAutograd's wrapper would have.
        kinds, bumps = _aot_kinds(aten_gm, dynamo_kinds), frozenset() if free else _versions_bumped_by_aot()
        if symbolic:
            traced = Traced.of(aten_gm, kinds, opts, bumps)
            per_shape = PerShape(traced, aten_gm, opts)
            if free:
                unwrapped.append(direct.Direct(per_shape, direct.returned_inputs(), direct.dynamic_dims()))
                if traced.converted is not None:
                    converted = direct.with_returned_inputs(traced.converted)
                    traced = dataclasses.replace(traced, converted=converted, dynamic=direct.dynamic_dims())
                    precompile.record(getattr(gm, "_backend_id", None), traced)
                    # Found again, AOTAutograd's guards on the sizes would be missing.
                    if graph_key is not None and graph_cache.shape_facts() == shape_facts:
                        graph_cache.store(graph_key, traced)
            return per_shape
        executable = compile_graph(aten_gm, kinds, opts, bumps)
        # Dynamo builds the frame's guards and code before the first call: time for a warm-up.
        executable.native.warm_up()
        if free:
            converted = direct.with_returned_inputs(executable.converted)
            unwrapped.append(direct.Direct(executable, converted.returned_inputs))
            # Set by Dynamo only under `caching_precompile`.
            precompile.record(getattr(gm, "_backend_id", None), converted)
            if graph_key is not None:
                graph_cache.store(graph_key, converted)
        return executable

    wrapped = aot_module_simplified(
        gm,
        list(args),
        fw_compiler=compiler,
        decompositions=decompositions(),
        # Input mutations (StaticCache K/V, buffers) stay in the graph as trailing `copy_`s that
        # become donated input/output aliases, instead of extra outputs AOTAutograd copies back.
        keep_inference_input_mutations=True,
    )
    if len(unwrapped) == 1:
        return unwrapped[0]
    return wrapped


def tpu_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
    name: str | None = None,
) -> Callable[..., Any]:
    """Dynamo backend entry: AOTAutograd to core ATen, then StableHLO and PJRT (see README)."""
    opts = options_mod.parse(options, mode, name)
    _check_inference(example_inputs)
    placeholders = gm.graph.find_nodes(op="placeholder")
    dynamo_kinds = [_dynamo_kind(n, v) for n, v in zip(placeholders, example_inputs)]
    return _aot_compile(gm, example_inputs, dynamo_kinds, opts)
