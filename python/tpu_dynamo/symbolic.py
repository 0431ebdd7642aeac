"""Graphs Dynamo traced with symbolic sizes: one AOTAutograd trace, one XLA compile per shape.

AOTAutograd runs once on the symbolic graph. Per new concrete input signature we only bind the
graph's size symbols from the actual inputs, convert with every size resolved to a literal, and
compile (milliseconds of Python plus the XLA compile); a signature seen before is a dict lookup.
Dynamo is never asked to recompile for a new size.
"""
from __future__ import annotations

from typing import Any

import sympy
import torch
import torch.fx

from . import debug
from .convert import InputKind
from .executable import Executable, compile_graph
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
        if options.buckets_requested:
            debug.log.info(
                "%s: num_dynamic_buckets/bucket_size: compiling exact shapes (padding a dynamic"
                " dim is not proven safe for this graph)",
                options.name or "graph",
            )

    def __call__(self, args: list[Any]) -> tuple[torch.Tensor | None, ...]:
        signature = tuple((a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else a for a in args)
        exe = self.compiled.get(signature)
        if exe is None:
            resolve = _resolver(_bindings(self.placeholders, args))
            exe = compile_graph(self.gm, self.kinds, self.options, self.caller_bumps, resolve)
            self.compiled[signature] = exe
        return exe(args)
