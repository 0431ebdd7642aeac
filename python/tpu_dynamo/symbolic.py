"""Graphs Dynamo traced with symbolic sizes: one AOTAutograd trace, one XLA compile per shape.

AOTAutograd runs once on the symbolic graph, and the graph is converted once, to a symbolic IR
that Rust keeps (`_native.SymbolicGraph`). Per new concrete input signature Rust binds the size
symbols from the input shapes and SymInt arguments, writes the concrete graph and compiles it (or
finds it in the memory/disk cache); a signature seen before is a dict lookup here. Dynamo is
never asked to recompile for a new size.

A graph whose sizes the IR cannot express (float/bool symbols, data-dependent sizes) falls back
to converting per signature in Python with every size resolved to a literal.

With TorchTPU's bucket options, sizes are padded up to their bucket where the compiler proves
that safe for the graph (`_native.SymbolicGraph.padding_plan`): the inputs are zero-padded, one
executable serves the whole bucket, and the outputs are cut back to the true sizes. Otherwise
shapes stay exact, and the log says which op prevents padding. Without them, where padding is
safe, a graph called on its own grown outputs (a dynamic-cache decode step: every call a new
length) is padded to powers of two from its second new size on, and any other graph whose sizes
keep changing from its SIZES_BEFORE_WARNING-th (the user is told), since every further size
would be another compile.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, NamedTuple

import sympy
import torch
import torch.fx

from . import _native, debug
from .convert import Converted, InputKind
from .executable import CallSizes, Derived, Executable, compile_graph, op_sequence, wrap
from .hoist import convert_hoisted
from .options import Buckets, Options, PowersOfTwo

# Graph outputs that are numbers rather than tensors (`bool` is an `int`).
_NUMBERS = (int, float, torch.SymInt, torch.SymFloat, torch.SymBool)

# Exact-shape compiles of one symbolic graph after which the user hears that sizes keep changing.
SIZES_BEFORE_WARNING = 8


@dataclasses.dataclass(frozen=True)
class _Scalar:
    """A symbolic number: its sympy expression and Python type."""

    expr: Any
    kind: type

    def value(self, bindings: dict[sympy.Symbol, int]) -> Any:
        """The number for the sizes `bindings`."""
        number = sympy.sympify(sympy.sympify(self.expr).xreplace(bindings))
        if number.free_symbols:
            raise NotImplementedError(
                f"tpu_dynamo: size {self.expr} depends on {sorted(map(str, number.free_symbols))},"
                " which no input size determines (data-dependent shapes are not supported)"
            )
        return self.kind(number)


_KINDS = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}


def _abstract(val: Any) -> Any:
    """A traced value as `Traced` keeps it: a tensor's sizes (ints, or sympy expressions where
    symbolic), a symbolic number as a `_Scalar`, a plain number as it is, anything else None."""
    if isinstance(val, torch.Tensor):
        return tuple(d.node.expr if isinstance(d, torch.SymInt) else int(d) for d in val.shape)
    kind = _KINDS.get(type(val))
    if kind is not None:
        return _Scalar(val.node.expr, kind)
    return val if isinstance(val, (int, float)) else None


def _is_symbolic(abstract: Any) -> bool:
    """Whether a placeholder (`_abstract`) has a symbolic size or is a symbolic number."""
    if isinstance(abstract, tuple):
        return any(not isinstance(d, int) for d in abstract)
    return isinstance(abstract, _Scalar)


def _bindings(placeholders: tuple[Any, ...], args: list[Any]) -> dict[sympy.Symbol, int]:
    """Each size symbol that appears as a whole input size (or SymInt input) -> its value now."""
    out: dict[sympy.Symbol, int] = {}
    for abstract, a in zip(placeholders, args):
        if isinstance(abstract, tuple):
            pairs = zip(abstract, a.shape)
        elif isinstance(abstract, _Scalar) and abstract.kind is int:
            pairs = zip([abstract.expr], [a])
        else:
            continue
        for sym, concrete in pairs:
            if isinstance(sym, sympy.Symbol):
                out[sym] = int(concrete)
    return out


def _resolver(bindings: dict[sympy.Symbol, int]):
    def resolve(x: Any) -> Any:
        kind = _KINDS.get(type(x))
        return x if kind is None else _Scalar(x.node.expr, kind).value(bindings)

    return resolve


@dataclasses.dataclass(frozen=True)
class Traced:
    """What `PerShape` takes from AOTAutograd's symbolic graph, picklable: a later process
    calls the graph again from it without tracing (precompile.py and graph_cache.py store it)."""

    converted: Converted | None
    """The symbolic IR's graph; None where the IR cannot express its sizes, so each signature
    is converted from the FX graph in Python and nothing can be stored."""
    kinds: tuple[InputKind, ...]
    options: Options
    """Without a `debug_callback` (a process's own)."""
    caller_bumps: frozenset[int]
    placeholders: tuple[Any, ...]
    """Per placeholder, its traced value (`_abstract`)."""
    number_outputs: tuple[tuple[int, Any], ...]
    """Graph outputs that are numbers computed from the inputs' sizes (a cache's new length): not
    results of the executable, but the same for every call of a signature (`_abstract`)."""
    ops: tuple[str, ...]
    fx_code: str
    dynamic: tuple[tuple[int, set[int]], ...] = ()
    """Where `direct.Direct` calls the graph, the outputs' symbolic dims it marks (`converted`
    names the outputs it returns as inputs)."""

    @staticmethod
    def of(gm: torch.fx.GraphModule, kinds: list[InputKind], options: Options, caller_bumps: frozenset[int]) -> Traced:
        try:
            converted: Converted | None = convert_hoisted(gm, kinds, options, symbolic=True)
        except (NotImplementedError, ValueError) as e:
            debug.log.info("%s: specializing per shape in Python: %s", options.name or "graph", e)
            converted = None
        return Traced(
            converted,
            tuple(kinds),
            dataclasses.replace(options, debug_callback=None),
            caller_bumps,
            tuple(_abstract(n.meta.get("val")) for n in gm.graph.find_nodes(op="placeholder")),
            tuple(
                (i, _abstract(o.meta["val"]))
                for i, o in enumerate(gm.graph.output_node().args[0])
                if isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), _NUMBERS)
            ),
            op_sequence(gm),
            gm.code,
        )


class _Plan(NamedTuple):
    """`_native.SymbolicGraph.padding_plan`'s answer, by name."""

    inputs: list[list[tuple[int, int]]]
    outputs: list[list[tuple[int, int, int]]]
    scalars: list[int | None]
    limits: list[tuple[int, int]]
    runtime: list[int]
    equal: list[tuple[int, int]]
    at_least: list[tuple[int, int, int]]
    at_most: list[tuple[int, int]]
    packed_inputs: list[int]
    packed_outputs: list[int]

    def holds(self, true: dict[int, int]) -> bool:
        """Whether the sizes `true` meet what the plan assumes of them."""
        return (
            all(true[a] == true[b] for a, b in self.equal)
            and all(true[a] >= true[b] + plus for a, b, plus in self.at_least)
            and all(true[sym] <= limit for sym, limit in self.at_most)
        )


class _PlanParts(NamedTuple):
    """What of a plan a bucketed call reads."""

    inputs: list[tuple[int, list[tuple[int, int]]]]
    """`(input, [(dimension, symbol)])` for each tensor input the plan pads."""
    outputs: list[tuple[int, list[tuple[int, int, int]]]]
    """`(output, [(dimension, symbol, plus)])` for each output it may cut."""
    exact: list[int]
    """Arguments with symbolic sizes it keeps exact (`PerShape.fixed`)."""


class PerShape:
    """AOTAutograd's compiled function for a symbolic ATen graph: specializes per signature."""

    _boxed_call = True

    def __init__(self, traced: Traced, gm: torch.fx.GraphModule | None = None, options: Options | None = None) -> None:
        """`gm`: the graph `traced` is of, needed only where the IR cannot express its sizes
        (`traced.converted` None); `options`: this process's, by default `traced.options`."""
        self.traced, self.gm = traced, gm
        self.options = options = options or traced.options
        self.compiled: dict[tuple[Any, ...], Executable | _Padded | _WithNumbers] = {}
        self.padded: dict[tuple[Any, ...], Executable] = {}
        self.compile_seconds = 0.0
        self.name = name = options.name or "graph"
        # Integer arguments the executable reads at run time (used only as numbers): their
        # values key nothing.
        self.number_args: tuple[int, ...] = ()
        self.symbolic: _native.SymbolicGraph | None = None
        # Values computed from weights alone (`Converted.prep`), shared by every signature's
        # executable: each call's arguments get them appended first.
        self.derived: Derived | None = None
        if traced.converted is not None:
            prep = traced.converted.prep
            self.derived = None if prep is None else Derived(prep, traced.converted.prep_args)
            self.converted = dataclasses.replace(traced.converted, prep=None)
            self.symbolic = _native.SymbolicGraph(self.converted.json)
            self.number_args = tuple(self.converted.scalar_args[p] for p in self.symbolic.number_scalars)
        # The inputs whose sizes or values can differ between calls and key the executable:
        # Dynamo's guards pin every other input's dtype and shape.
        self.varying = [
            i for i, p in enumerate(traced.placeholders) if _is_symbolic(p) and i not in self.number_args
        ]
        # Symbol -> the argument carrying it, for the numbers read at run time.
        self.number_symbols = {traced.placeholders[i].expr: i for i in self.number_args}
        self.plan: _Plan | None = None
        self._parts_of: tuple[_Plan, _PlanParts] | None = None
        # The graph `plan` is for, and the sizes it keeps exact (symbol -> value): this graph
        # with those fixed when only the others can be padded (`_adopt_padding`).
        self.padded_graph = self.symbolic
        self.fixed: dict[int, int] = {}
        self.buckets: Buckets | PowersOfTwo | None = options.buckets
        # The last new signature's sizes (symbol -> size), to tell a decode step.
        self.last_sizes: dict[int, int] | None = None
        if options.buckets is not None:
            self.plan, why = self._padding
            if self.plan is not None:
                debug.log.info("%s: buckets: padding symbolic sizes to multiples of %d", name, options.buckets.size)
            else:
                debug.log.info("%s: buckets: compiling exact shapes, padding is not proven safe: %s", name, why)

    def __call__(self, args: list[Any]) -> tuple[torch.Tensor | None, ...]:
        if self.derived is not None:
            args.extend(self.derived(args))
        signature = tuple(args[i].shape if isinstance(args[i], torch.Tensor) else args[i] for i in self.varying)
        exe = self.compiled.get(signature)
        if exe is None:
            if self.plan is None:
                self._adopt_padding(args)
            start = time.perf_counter()
            exe = self._compile(args)
            if self.traced.number_outputs:
                bindings = _bindings(self.traced.placeholders, args)
                exe = _WithNumbers(exe, self.traced.number_outputs, bindings, self.number_symbols)
            self.compile_seconds += time.perf_counter() - start
            self.compiled[signature] = exe
            if len(self.compiled) == SIZES_BEFORE_WARNING and self.plan is None:
                self._sizes_keep_changing()
        return exe(args)

    def _adopt_padding(self, args: list[Any]) -> None:
        """Starts padding from this new signature on where that is proven safe, either for the
        whole graph or, when only the sizes that changed since the last new signature can be
        padded, with the others kept exact (a hybrid model's sliding-window cache, full and of
        constant length, beside a full-attention cache that grows). With bucket options it pads
        to them; without, only a graph called on its own grown outputs (a dynamic cache's decode
        step, where every call is a new length and exact shapes compile on every step) pads to
        powers of two, at once rather than after SIZES_BEFORE_WARNING exact sizes."""
        if self.symbolic is None:
            return
        sizes = self._symbol_sizes(args)
        last, self.last_sizes = self.last_sizes, sizes
        if last is None:
            return
        graph, (plan, _) = self.symbolic, self._padding
        steady = {}
        if plan is None:
            steady = {k: v for k, v in sizes.items() if last.get(k) == v}
            if not steady or len(steady) == len(sizes):
                return
            try:
                graph = self.symbolic.fix(list(steady.items()))
                plan = _Plan(*graph.padding_plan())
            except ValueError:
                return
        if self.options.buckets is None:
            grown = {(sym, plus) for cuts in plan.outputs for _, sym, plus in cuts if plus > 0}
            if not grown or any(sizes[sym] != last[sym] + plus for sym, plus in grown):
                return
            self.buckets = PowersOfTwo()
            how = (
                "called on its own grown outputs (a dynamic cache's decode step): padding sizes to the next "
                "power of two from now on, one executable per doubling"
            )
        else:
            how = f"buckets: padding symbolic sizes to multiples of {self.options.buckets.size}"
        debug.log.info("%s: %s%s", self.name, how, f"; sizes {sorted(steady.values())} stay exact" if steady else "")
        self.plan, self.padded_graph, self.fixed = plan, graph, steady

    def _symbol_sizes(self, args: list[Any]) -> dict[int, int]:
        """Each size symbol's value in this call (those of the tensor inputs' dimensions)."""
        tensor_args = self.converted.tensor_args
        return {sym: args[tensor_args[i]].shape[d] for i, dims in enumerate(self._input_symbols) for d, sym in dims}

    @functools.cached_property
    def _input_symbols(self) -> list[list[tuple[int, int]]]:
        """Per tensor input, its `(dimension, symbol)` pairs."""
        assert self.symbolic is not None
        return self.symbolic.input_symbols[: len(self.converted.tensor_args)]

    def _sizes_keep_changing(self) -> None:
        """Each new size is an XLA compile; a workload whose sizes never repeat (a dynamic-cache
        decode: every step a new length) compiles on every call. Where this graph's padding plan
        holds and the user chose no buckets, later sizes are padded to powers of two; either way
        the user hears what is happening and what to do."""
        plan, why = self._padding
        if self.options.buckets is not None:
            pad = "; padding them to buckets was refused for this graph (the INFO log says why)"
        elif plan is not None:
            self.plan, self.buckets = plan, PowersOfTwo()
            pad = (
                "; from now on this graph runs with its sizes padded to the next power of two (proven safe"
                ' for it; options={"bucket_size": ...} pads from the first call, to buckets of your choice)'
            )
        else:
            pad = f"; padding them to buckets cannot help this graph: {why}"
        debug.log.warning(
            "%s: compiled for %d input sizes so far (%.1f s compiling or loading them); every new "
            "size is another executable, so sizes that keep changing (e.g. generate() with the "
            "default dynamic cache, where each step is a new length) keep compiling. Fix the sizes "
            '(cache_implementation="static" for LLM decode)%s',
            self.name, len(self.compiled), self.compile_seconds, pad,
        )

    @functools.cached_property
    def _padding(self) -> tuple[_Plan | None, str | None]:
        """How to run this graph padded to buckets, or None and why it cannot be."""
        if self.symbolic is None:
            return None, "the graph is specialized in Python (the INFO log says why)"
        try:
            return _Plan(*self.symbolic.padding_plan()), None
        except ValueError as e:
            return None, str(e)

    def _compile(self, args: list[Any]) -> Executable | _Padded:
        if self.plan is not None:
            true = _true_sizes(self._parts.inputs, self.converted.tensor_args, args)
            fixed = not self.fixed or all(self._symbol_sizes(args)[k] == v for k, v in self.fixed.items())
            if fixed and self.plan.holds(true):
                return self._bucketed(args, true)
            debug.log.info("%s: buckets: sizes differ from what the padding assumes; compiling exact shapes", self.name)
        if self.symbolic is None:
            assert self.gm is not None  # `Traced` is stored only with the IR's graph
            resolve = _resolver(_bindings(self.traced.placeholders, args))
            return compile_graph(self.gm, list(self.traced.kinds), self.options, self.traced.caller_bumps, resolve)
        c = self.converted
        shapes = [list(args[i].shape) for i in c.tensor_args] + [list(t.shape) for t in c.constants]
        return self._specialize(shapes, self._scalars(args))

    def _scalars(self, args: list[Any]) -> list[int]:
        """The integer arguments' values for `specialize`; those read at run time do not shape
        the executable (0 stands for any)."""
        return [0 if i in self.number_args else int(args[i]) for i in self.converted.scalar_args]

    def _specialize(
        self,
        shapes: list[list[int]],
        scalars: list[int],
        n_args: int = 0,
        n_lengths: int = 0,
        graph: _native.SymbolicGraph | None = None,
    ) -> Executable:
        """The executable for these shapes (of `graph`, by default this symbolic graph). Padded
        with `n_lengths` true sizes read at run time, the caller appends those to its `n_args`
        arguments; in the IR they precede the constants."""
        start = time.perf_counter()
        graph = graph or self.symbolic
        assert graph is not None
        c = self.converted
        at = len(c.tensor_args)
        numbers = len(self.number_args)
        native = graph.specialize(
            shapes,
            scalars,
            at if n_lengths else None,
            at + n_lengths if numbers else None,
            need_stablehlo=debug.wanted(self.options),
        )
        if n_lengths or numbers:
            # Where the plugin computes in host memory a true size is staged, 8 bytes copied
            # per input and call; on a device one upload per value is shared by every input
            # that reads it (`_length_tensor`).
            length = InputKind.USER if native.hands_over_outputs else InputKind.CONSTANT
            c = dataclasses.replace(
                c,
                tensor_args=c.tensor_args + tuple(range(n_args, n_args + n_lengths)),
                number_args=self.number_args,
                kinds=c.kinds[:at]
                + (length,) * n_lengths
                + (InputKind.USER,) * numbers
                + c.kinds[at:],
            )
        t = self.traced
        return wrap(native, t.ops, t.fx_code, c, self.options, t.caller_bumps, start)

    def _bucketed(self, args: list[Any], true: dict[int, int]) -> _Padded:
        """The call for `args`' sizes (`true`): the executable of their buckets, shared by every
        size in them, with the padding of the inputs and the cut of the outputs. It runs on every
        decode step at a length not seen before, so it reads only the inputs the plan pads
        (a SmolLM-135M step's 60 K/V of its 395 inputs: 0.85 ms a step when it read them all)."""
        assert self.plan is not None and self.buckets is not None
        plan = self.plan
        c = self.converted
        padded = {sym: self.buckets.pad(n) for sym, n in true.items()}
        # A size that is another's plus a constant (a batched decode's attention mask, one
        # longer than its cache) keeps that offset padded, so a bucket's boundary does not
        # split one bucket's calls over two executables.
        for a, b, plus in plan.at_least:
            if true[a] == true[b] + plus:
                padded[a] = padded[b] + plus
        for sym, limit in plan.limits:
            padded[sym] = max(true[sym], min(padded[sym], limit))
        given, bucket = {}, {}
        parts = self._parts
        for i, pairs in parts.inputs:
            true_shape = list(args[c.tensor_args[i]].shape)
            shape = true_shape.copy()
            for d, sym in pairs:
                shape[d] = padded[sym]
            bucket[i] = shape
            if true_shape != shape:
                given[i] = true_shape
        scalars = [padded[sym] if sym is not None else v for v, sym in zip(self._scalars(args), plan.scalars)]
        # With the sizes the plan keeps exact (`fixed`), these name the bucket: Dynamo's guards
        # pin every other input's shape.
        exact = tuple(args[a].shape for a in parts.exact)
        key = (tuple(tuple(shape) for shape in bucket.values()), exact, tuple(scalars))
        exe = self.padded.get(key)
        if exe is None:
            shapes = [list(args[i].shape) for i in c.tensor_args] + [list(t.shape) for t in c.constants]
            for i, shape in bucket.items():
                shapes[i] = shape
            exe = self.padded[key] = self._specialize(shapes, scalars, len(args), len(plan.runtime), self.padded_graph)
        scalar_pads = [(i, padded[sym]) for i, sym in zip(c.scalar_args, plan.scalars) if sym is not None]
        cut = {}
        for o, cuts in parts.outputs:
            dims = list(exe.out_types[o][1])
            for d, sym, plus in cuts:
                dims[d] = true[sym] + plus
            if dims != list(exe.out_types[o][1]):
                cut[o] = dims
        lengths = [_length_tensor(true[sym]) for sym in plan.runtime]
        if debug.log.isEnabledFor(logging.INFO):
            debug.log.info(
                "%s: buckets: sizes %s run padded to %s", self.name, sorted(true.values()), sorted(padded.values())
            )
        packed = (frozenset(plan.packed_inputs), frozenset(plan.packed_outputs))
        return _Padded(exe, exe.resized(given, cut, packed), scalar_pads, lengths)

    @property
    def _parts(self) -> _PlanParts:
        """`_PlanParts` of the plan in use, worked out once per plan."""
        plan = self.plan
        assert plan is not None
        if self._parts_of is None or self._parts_of[0] is not plan:
            c = self.converted
            inputs = [(i, pairs) for i, pairs in enumerate(plan.inputs) if pairs]
            outputs = [(o, plan.outputs[o]) for o in sorted(set(c.outputs) - {None}) if plan.outputs[o]]
            padded_args = {c.tensor_args[i] for i, _ in inputs}
            exact = [a for a in self.varying if a in c.tensor_args and a not in padded_args]
            self._parts_of = (plan, _PlanParts(inputs, outputs, exact))
        return self._parts_of[1]


def _true_sizes(
    inputs: list[tuple[int, list[tuple[int, int]]]], tensor_args: tuple[int, ...], args: list[Any]
) -> dict[int, int]:
    """Each padded symbol's size in this call (`inputs`: `_PlanParts.inputs`)."""
    return {sym: args[tensor_args[i]].shape[d] for i, pairs in inputs for d, sym in pairs}


@functools.lru_cache(maxsize=8192)
def _length_tensor(n: int) -> torch.Tensor:
    """The 0-d tensor a padded executable reads a true size from, one per value. On a CPU
    plugin it is a user input, copied into the buffer the executable keeps for it (as a
    resident one it changed on every decode step, and each step paid an upload and a slot's
    bookkeeping); on a device, resident, so one upload a step serves every input that reads
    this size (a decode step reads one per layer's K and V). Made outside inference mode: an
    inference tensor has no version, so it could not stay resident."""
    with torch.inference_mode(False):
        return torch.tensor(n, dtype=torch.int64)


class _Padded:
    """A call at sizes below their bucket's: runs the bucket's executable with the inputs
    padded along their symbolic dimensions and the outputs cut back to the true sizes (both
    done by the native run: `sizes`), passing the padded scalars and the true sizes the
    executable reads at run time. A cut output is contiguous like the graph's own: a strided
    view fed back in (a dynamic cache's K/V next step) would fail Dynamo's stride guards. A
    tensor padded along one dimension only is packed (its true elements first, in its own
    order): a cut result is then the prefix of the executable's buffer, handed over in place,
    and fed back in next step it is read there, with no copy either way."""

    _boxed_call = True

    def __init__(
        self, exe: Executable, sizes: CallSizes, scalars: list[tuple[int, int]], lengths: list[torch.Tensor]
    ) -> None:
        self.exe, self.sizes, self.scalars, self.lengths = exe, sizes, scalars, lengths

    def __call__(self, args: list[Any]) -> tuple[torch.Tensor | None, ...]:
        args = list(args)
        for i, value in self.scalars:
            args[i] = value
        args.extend(self.lengths)
        return self.exe(args, self.sizes)


class _WithNumbers:
    """A call whose graph also returns numbers, spliced in among the executable's results: the
    same for every call of the signature, except those computed from numbers read at run time
    (`number_symbols`: symbol -> argument), worked out per call."""

    _boxed_call = True

    def __init__(
        self,
        call: Executable | _Padded,
        outputs: tuple[tuple[int, Any], ...],
        bindings: dict[sympy.Symbol, int],
        number_symbols: dict[sympy.Symbol, int],
    ) -> None:
        def per_call(val: Any) -> bool:
            return isinstance(val, _Scalar) and val.kind is int and not val.expr.free_symbols.isdisjoint(number_symbols)

        self.call, self.bindings, self.number_symbols = call, bindings, number_symbols
        self.numbers = [(i, val.value(bindings) if isinstance(val, _Scalar) else val) for i, val in outputs if not per_call(val)]
        self.per_call = [(i, val) for i, val in outputs if per_call(val)]

    def __call__(self, args: list[Any]) -> tuple[Any, ...]:
        now = {sym: int(args[i]) for sym, i in self.number_symbols.items()} if self.per_call else {}
        outs = list(self.call(args))
        for i, value in self.numbers:
            outs[i] = value
        if self.per_call:
            bindings = {**self.bindings, **now}
            for i, val in self.per_call:
                outs[i] = val.value(bindings)
        return tuple(outs)

