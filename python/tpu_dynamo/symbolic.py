"""Graphs Dynamo traced with symbolic sizes: one AOTAutograd trace, one XLA compile per shape.

AOTAutograd runs once on the symbolic graph, and the graph is converted once, to a symbolic IR
that Rust keeps (`_native.SymbolicGraph`). Per new concrete input signature Rust binds the size
symbols from the input shapes and SymInt arguments, writes the concrete graph and compiles it (or
finds it in the memory/disk cache); a signature seen before is a dict lookup here. Dynamo is
never asked to recompile for a new size.

A graph whose sizes the IR cannot express (float/bool symbols, data-dependent sizes) falls back
to converting per signature in Python with every size resolved to a literal.
"""
from __future__ import annotations

import time
from typing import Any

import sympy
import torch
import torch.fx

from . import _native, debug
from .convert import InputKind, convert_symbolic
from .executable import Executable, compile_graph, wrap
from .options import Options


def _bindings(placeholders: list[torch.fx.Node], args: list[Any]) -> dict[sympy.Symbol, int]:
    """Each size symbol that appears as a whole input size (or SymInt input) -> its value now."""
    out: dict[sympy.Symbol, int] = {}
    for n, a in zip(placeholders, args):
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            pairs = zip(val.shape, a.shape)
        elif isinstance(val, torch.SymInt):
            pairs = zip([val], [a])
        else:
            continue
        for sym, concrete in pairs:
            if isinstance(sym, torch.SymInt) and isinstance(sym.node.expr, sympy.Symbol):
                out[sym.node.expr] = int(concrete)
    return out


def _resolver(bindings: dict[sympy.Symbol, int]):
    def resolve(x: Any) -> Any:
        if not isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return x
        expr = sympy.sympify(sympy.sympify(x.node.expr).xreplace(bindings))
        if expr.free_symbols:
            raise NotImplementedError(
                f"tpu_dynamo: size {x.node.expr} depends on {sorted(map(str, expr.free_symbols))},"
                " which no input size determines (data-dependent shapes are not supported)"
            )
        kind = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(x)]
        return kind(expr)

    return resolve


class PerShape:
    """AOTAutograd's compiled function for a symbolic ATen graph: specializes per signature."""

    _boxed_call = True

    def __init__(
        self, gm: torch.fx.GraphModule, kinds: list[InputKind], options: Options, caller_bumps: frozenset[int]
    ) -> None:
        self.gm, self.kinds, self.options, self.caller_bumps = gm, kinds, options, caller_bumps
        self.placeholders = gm.graph.find_nodes(op="placeholder")
        self.compiled: dict[tuple[Any, ...], Executable] = {}
        name = options.name or "graph"
        if options.buckets_requested:
            debug.log.info(
                "%s: num_dynamic_buckets/bucket_size: compiling exact shapes (padding a dynamic"
                " dim is not proven safe for this graph)",
                name,
            )
        try:
            self.converted = convert_symbolic(gm, kinds)
            self.symbolic: _native.SymbolicGraph | None = _native.SymbolicGraph(self.converted.json)
        except (NotImplementedError, ValueError) as e:
            debug.log.info("%s: specializing per shape in Python: %s", name, e)
            self.symbolic = None

    def __call__(self, args: list[Any]) -> tuple[torch.Tensor | None, ...]:
        signature = tuple((a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else a for a in args)
        exe = self.compiled.get(signature)
        if exe is None:
            exe = self._compile(args)
            self.compiled[signature] = exe
        return exe(args)

    def _compile(self, args: list[Any]) -> Executable:
        if self.symbolic is None:
            resolve = _resolver(_bindings(self.placeholders, args))
            return compile_graph(self.gm, self.kinds, self.options, self.caller_bumps, resolve)
        start, c = time.perf_counter(), self.converted
        shapes = [list(args[i].shape) for i in c.tensor_args] + [list(t.shape) for t in c.constants]
        native = self.symbolic.specialize(
            shapes, [int(args[i]) for i in c.scalar_args], need_stablehlo=debug.wanted(self.options)
        )
        return wrap(native, self.gm, c, self.options, self.caller_bumps, start)
