"""Work on weights alone, done once per weight version instead of on every call.

The nodes of a graph that read only parameters, buffers and constants (never a user input, nor
an input the graph updates) give the same values on every call until a weight changes: a rotary
table from `inv_freq`, position embeddings gathered at `arange` positions, autocast's bf16 copy
of every weight, a weight-normed or LoRA-merged weight. `convert_hoisted` moves them into a graph
of their own, the *prep* graph, whose results the main graph takes as extra resident inputs; the
executable runs the prep graph again only after one of its inputs changed (`executable.Derived`).

A derived value is kept in memory for as long as the graph lives, so one is hoisted only when it
is no larger than the weights it is computed from (plus `_ALLOWANCE`, for tables computed from a
few numbers): a dequantized weight, twice its int8 source, is computed on every call as before.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
import torch.fx

from . import debug
from .convert import Converted, InputKind, convert, convert_symbolic
from .options import Options

aten = torch.ops.aten

# Ops that copy a value as it is: worth nothing to precompute.
_COPIES = frozenset({aten.lift_fresh_copy.default, aten.clone.default, aten.alias.default, aten.detach.default})

# A derived value may exceed what it is computed from by this many bytes (a rotary table from
# `inv_freq`'s few numbers, an `arange`'s positions).
_ALLOWANCE = 1 << 20

# A prep graph is one more compile and, after a weight changes, one more execute: worth it when
# it saves a call reading and writing at least this many bytes (a weight-normed `[32, 32]`
# layer's weight is computed in the graph as before), or the transcendental work below.
_WORTHWHILE = 1 << 20

# Ops of many instructions per element (`sin` and `cos` a scalar libm call each on XLA:CPU,
# `compiler/src/lower/trig.rs`), which XLA recomputes in every fusion that reads them: a tiny
# Llama's rotary table, cos and sin of `[1, 128, 32]` (32 KiB in all), cost 13-18 % of its
# execute. Weight work with this many of their elements pays for a prep graph whatever its bytes.
_TRANSCENDENTAL = frozenset(
    {aten.sin.default, aten.cos.default, aten.exp.default, aten.log.default, aten.tanh.default, aten.pow.Tensor_Tensor}
)
_WORTHWHILE_TRANSCENDENTAL = 4096


@dataclass(frozen=True)
class Split:
    main: torch.fx.GraphModule
    """The graph with every hoisted value as a placeholder after its own ones."""
    main_kinds: list[InputKind]
    prep: torch.fx.GraphModule
    """Computes the hoisted values, in the order of `main`'s new placeholders."""
    prep_args: tuple[int, ...]
    """Positions among the graph's arguments of the prep graph's placeholders."""


def convert_hoisted(
    gm: torch.fx.GraphModule, kinds: list[InputKind], options: Options, symbolic: bool = False
) -> Converted:
    """`convert(gm, kinds)` (`convert_symbolic` if `symbolic`), with the values computed from
    weights alone moved to its `prep` graph unless `options.precompute_weights` is off."""
    to_ir = convert_symbolic if symbolic else convert
    split = split_weight_work(gm, kinds) if options.precompute_weights else None
    if split is None:
        return to_ir(gm, kinds)
    derived = split.main.graph.find_nodes(op="placeholder")[len(kinds) :]
    debug.log.info(
        "%s: %d values computed from weights alone (%.1f MiB) are kept, and computed again only when a weight"
        " changes",
        options.name or "graph",
        len(derived),
        sum(map(_nbytes, derived)) / 2**20,
    )
    prep = convert(split.prep, [InputKind.USER] * len(split.prep_args))
    return dataclasses.replace(to_ir(split.main, split.main_kinds), prep=prep, prep_args=split.prep_args)


def _pure(n: torch.fx.Node) -> bool:
    """Whether `n` computes tensors of static sizes from its inputs alone: no effect, no
    randomness, no update."""
    val = n.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    if not vals or not all(isinstance(v, torch.Tensor) and all(type(d) is int for d in v.shape) for v in vals):
        return False
    if n.target is operator.getitem:
        return isinstance(val, torch.Tensor)
    return (
        isinstance(n.target, torch._ops.OpOverload)
        and not n.target._schema.is_mutable
        and torch.Tag.nondeterministic_seeded not in n.target.tags
    )


def _updates(n: torch.fx.Node) -> list[torch.fx.Node]:
    """The inputs `n` may write (all of them, for an op that writes any or that has effects)."""
    if n.op != "call_function" or n.target is operator.getitem:
        return []
    if isinstance(n.target, torch._ops.OpOverload) and not n.target._schema.is_mutable:
        return []
    return n.all_input_nodes


def _copies(n: torch.fx.Node) -> bool:
    """Whether `n` copies its input as it is: worth nothing to precompute."""
    if n.target is aten._to_copy.default:
        return _value(n).dtype == _value(n.args[0]).dtype  # type: ignore[arg-type]
    return n.target in _COPIES


def _is_view(n: torch.fx.Node) -> bool:
    """Whether `n` only reinterprets its input (a getitem as its multi-output base)."""
    if n.target is operator.getitem:
        return _is_view(n.args[0])  # type: ignore[arg-type]
    return n.op in ("placeholder", "get_attr") or n.target.is_view  # type: ignore[union-attr]


def _value(n: torch.fx.Node) -> torch.Tensor:
    """The (fake) tensor of a tensor node."""
    if n.op == "get_attr":
        return operator.attrgetter(n.target)(n.graph.owning_module)  # type: ignore[arg-type]
    return n.meta["val"]


def _nbytes(n: torch.fx.Node) -> int:
    t = _value(n)
    return t.numel() * t.element_size()


def split_weight_work(gm: torch.fx.GraphModule, kinds: list[InputKind]) -> Split | None:
    """Splits off the values `gm` computes from weights alone (see the module docs); `None` when
    there are none worth keeping. `kinds`: one per placeholder."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    updated = {a for n in nodes for a in _updates(n)}
    static = {
        p
        for p, kind in zip(placeholders, kinds, strict=True)
        if kind is not InputKind.USER and p not in updated and isinstance(p.meta.get("val"), torch.Tensor)
    }
    static.update(n for n in nodes if n.op == "get_attr")
    # Whether a static node computes anything: a view or copy of weights does not.
    work: dict[torch.fx.Node, bool] = {n: False for n in static}
    for n in nodes:
        if n.op == "call_function" and _pure(n) and all(a in static for a in n.all_input_nodes):
            static.add(n)
            work[n] = not (_is_view(n) or _copies(n)) or any(work[a] for a in n.all_input_nodes)
    # Sources of each static node: the weights (and constants) it is computed from.
    sources: dict[torch.fx.Node, frozenset[torch.fx.Node]] = {}
    for n in nodes:
        if n in static:
            sources[n] = frozenset([n]) if n.op != "call_function" else frozenset().union(
                *(sources[a] for a in n.all_input_nodes)
            )
    # What the main graph reads of the static nodes, walking back from its own: a static node
    # that computes something is hoisted there, while views (and copies) of one stay in the main
    # graph on top of it (one value kept, not a copy per view). A value too large to keep is
    # computed in the main graph after all, and its inputs are looked at in its place.
    computed_in_main: set[torch.fx.Node] = set()
    while True:
        in_main = {n for n in nodes if n not in static}
        hoisted_set: set[torch.fx.Node] = set()
        stack = list(in_main)
        while stack:
            for a in stack.pop().all_input_nodes:
                if work.get(a) and not _is_view(a) and not _copies(a) and a not in computed_in_main:
                    hoisted_set.add(a)
                elif a not in in_main:
                    in_main.add(a)
                    stack.append(a)
        hoisted = [n for n in nodes if n in hoisted_set]
        too_large = [
            n
            for n in hoisted
            if not isinstance(n.meta["val"], torch.Tensor)
            or _nbytes(n) > sum(_nbytes(s) for s in sources[n]) + _ALLOWANCE
        ]
        if not too_large:
            break
        computed_in_main.update(too_large)
    moved = sum(map(_nbytes, hoisted)) + sum(map(_nbytes, frozenset().union(*(sources[n] for n in hoisted))))
    if moved < _WORTHWHILE and _transcendental_elements(hoisted) < _WORTHWHILE_TRANSCENDENTAL:
        return None
    return _build(gm, nodes, placeholders, kinds, in_main, hoisted)


def _computing(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """`nodes` and every node they are computed from."""
    found: set[torch.fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack.extend(n.all_input_nodes)
    return found


def _transcendental_elements(hoisted: list[torch.fx.Node]) -> int:
    """Elements the `_TRANSCENDENTAL` ops computing `hoisted` produce."""
    return sum(_value(n).numel() for n in _computing(hoisted) if n.target in _TRANSCENDENTAL)


def _build(
    gm: torch.fx.GraphModule,
    nodes: list[torch.fx.Node],
    placeholders: list[torch.fx.Node],
    kinds: list[InputKind],
    in_main: set[torch.fx.Node],
    hoisted: list[torch.fx.Node],
) -> Split:
    """The prep graph (the hoisted values and what they need) and the main graph (the rest, with
    the hoisted values as its last placeholders)."""
    needed = _computing(hoisted)
    prep, env = torch.fx.Graph(), {}
    prep_args = []
    for n in nodes:
        if n in needed:
            env[n] = prep.node_copy(n, env.__getitem__)
            if n.op == "placeholder":
                prep_args.append(placeholders.index(n))
    prep.output(tuple(env[n] for n in hoisted))

    main, env = torch.fx.Graph(), {}
    for n in placeholders:
        env[n] = main.node_copy(n, env.__getitem__)
    for k, n in enumerate(hoisted):
        env[n] = main.placeholder(f"derived_{k}")
        env[n].meta = {"val": n.meta["val"]}
    for n in nodes:
        if n.op != "placeholder" and n not in env and (n in in_main or n.op == "output"):
            env[n] = main.node_copy(n, env.__getitem__)
    main_gm = torch.fx.GraphModule(gm, main)
    main_gm.graph.eliminate_dead_code()
    main_kinds = [*kinds, *[InputKind.CONSTANT] * len(hoisted)]
    return Split(main_gm, main_kinds, torch.fx.GraphModule(gm, prep), tuple(prep_args))
