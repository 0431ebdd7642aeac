"""ATen FX graph -> graph IR (the JSON that `compiler/src/ir.rs` deserializes).

The IR is canonical: values are numbered by position (inputs, then node outputs in graph order),
never by FX node name, and keyword arguments are sorted, so the same model yields the same
canonical bytes in every process. Source lines travel beside the graph, only for error messages.
"""
from __future__ import annotations

import json
import operator
import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import sympy
import torch
import torch.fx
import torch.utils._sympy.functions as symfn
from torch._functorch._aot_autograd.descriptors import ForwardTokenAOTInput
from torch._subclasses.fake_tensor import FakeTensor

from ._native import LowerError

# The value of an effect token (placeholder or `with_effects` result): AOTAutograd passes None
# for it and drops it from the results, so it is no IR value.
_TOKEN = -1

_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "bool",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float64: "f64",
    torch.complex64: "c64",
}

# Placement, not value: the device is ours to choose, and pinning is a host-memory detail.
_DROPPED_KWARGS = frozenset({"device", "pin_memory"})

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class InputKind(str, Enum):
    """Where an input comes from. Parameters, buffers and constants stay resident on the device."""

    USER = "user"
    PARAMETER = "parameter"
    BUFFER = "buffer"
    CONSTANT = "constant"


@dataclass(frozen=True)
class Converted:
    """A converted graph and what the runtime wrapper needs to call it."""

    json: str
    """`GraphWithSources` JSON."""
    tensor_args: tuple[int, ...]
    """Positions of the graph's tensor placeholders among its arguments (the IR inputs)."""
    kinds: tuple[InputKind, ...]
    """Kind of every IR input: the graph's tensor placeholders, then its `constants`."""
    constants: tuple[torch.Tensor, ...]
    """Tensors read through `get_attr`; they follow the placeholders as IR inputs."""
    outputs: tuple[int | None, ...]
    """Per graph output: the index into the executable's results, or None for a None
    output or a number (a size, which `symbolic.PerShape` returns)."""
    mutations: tuple[tuple[int, int], ...] = ()
    """`(IR input, result index)` per input the graph updates in place (`copy_` into it)."""
    scalar_args: tuple[int, ...] = ()
    """Symbolic graphs: positions of the integer arguments that the IR's `scalars` describe."""
    checks: tuple[tuple[int, str, bool], ...] = ()
    """`(result index, api name, is_matrix)` per `_linalg_check_errors` of an `info` result: the
    wrapper raises PyTorch's error for it after the call."""
    number_args: tuple[int, ...] = ()
    """Positions of integer arguments the executable reads as 0-d int64 inputs (after the
    tensor placeholders, before the constants; `symbolic.PerShape`)."""
    returned_inputs: tuple[tuple[int, int], ...] = ()
    """`(graph output, argument)` per output that is an argument itself (AOTAutograd's
    `is_input`, e.g. a cache updated in place and returned): a graph called without AOTAutograd's
    wrapper returns that very tensor, as eager does, in place of the executable's result."""
    prep: Converted | None = None
    """The graph computing this one's values from weights alone (hoist.py): its results are
    this graph's last inputs, recomputed only when a weight changes."""
    prep_args: tuple[int, ...] = ()
    """Positions among this graph's arguments of the `prep` graph's inputs."""
    result_devices: tuple[str, ...] = ()
    """Per result that is a graph output (the first results), the device it was traced on
    (`str(torch.device)`): a call on a GPU gives one traced on the CPU (the graph's `.cpu()`)
    back on the host."""
    gpu: str | None = None
    """The GPU the graph was traced on (`str(torch.device)`), if any tensor of the trace was on
    one: its calls run there (`Executable._on_device`), even with host tensors alone as inputs."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise NotImplementedError(f"tpu_dynamo: dtype {dtype} is not supported") from None


SizeResolver = Callable[[Any], Any]
"""Maps a symbolic size (`torch.SymInt`/`SymFloat`/`SymBool`) to its value for one call."""


def _static(x: Any) -> Any:
    return x


@dataclass(frozen=True)
class SymbolicSize:
    """A size kept symbolic in the IR: its `SymExpr` (JSON); the graph holds 0 in its place."""

    expr: Any


def _sorted(exprs: list[Any]) -> list[Any]:
    """Operands of a commutative op in a name-independent order (sympy's depends on names)."""
    return sorted(exprs, key=lambda e: json.dumps(e, sort_keys=True))


class SymbolNames:
    """`convert_symbolic`'s resolver: a SymInt -> its `SymExpr`, or its int if constant.

    Only symbols that some input dimension or SymInt input is exactly can be bound at call time;
    they are numbered by first appearance among the placeholders, not by the tracer's names.
    """

    def __init__(self, placeholders: list[torch.fx.Node]) -> None:
        self.symbols: dict[sympy.Symbol, int] = {}
        for n in placeholders:
            val = n.meta.get("val")
            for d in val.shape if isinstance(val, torch.Tensor) else [val]:
                if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol):
                    self.symbols.setdefault(d.node.expr, len(self.symbols))

    def __call__(self, x: Any) -> Any:
        if not isinstance(x, _SYMBOLIC):
            return x
        if not isinstance(x, torch.SymInt):
            raise NotImplementedError(f"tpu_dynamo: symbolic {type(x).__name__} {x.node.expr}")
        expr = self.expr(sympy.sympify(x.node.expr))
        return expr["const"] if "const" in expr else SymbolicSize(expr)

    def expr(self, e: sympy.Expr) -> dict[str, Any]:
        """The `SymExpr` JSON of `e` (see compiler/src/ir.rs)."""
        args = [self.expr(a) for a in e.args] if not e.is_Atom else []
        if isinstance(e, sympy.Integer):
            return {"const": int(e)}
        if isinstance(e, sympy.Symbol):
            if e not in self.symbols:
                raise NotImplementedError(
                    f"tpu_dynamo: size symbol {e} is not an input size (data-dependent sizes are not supported)"
                )
            return {"sym": self.symbols[e]}
        if isinstance(e, (sympy.Add, sympy.Mul, sympy.Max, sympy.Min, symfn.Max, symfn.Min)):
            name = {sympy.Add: "add", sympy.Mul: "mul"}.get(type(e), type(e).__name__.lower())
            return {name: _sorted(args)}
        if isinstance(e, symfn.FloorDiv):
            return {"floordiv": args}
        if isinstance(e, (sympy.Mod, symfn.Mod, symfn.PythonMod)):
            return {"mod": args}
        if isinstance(e, symfn.ModularIndexing):
            base, divisor, modulus = args
            return {"mod": [{"floordiv": [base, divisor]}, modulus]}
        if isinstance(e, (sympy.Pow, symfn.PowByNatural)) and isinstance(e.args[1], sympy.Integer) and e.args[1] >= 0:
            return {"pow": [args[0], int(e.args[1])]}
        if isinstance(e, symfn.Identity):
            return args[0]
        raise NotImplementedError(f"tpu_dynamo: size expression {e} ({type(e).__name__}) is not supported")


def tensor_type(t: Any, what: str, resolve: SizeResolver = _static) -> dict[str, Any]:
    if not isinstance(t, torch.Tensor):
        raise NotImplementedError(f"tpu_dynamo: {what} is a {type(t).__name__}, not a tensor")
    shape = []
    for d in map(resolve, t.shape):
        if not isinstance(d, (int, SymbolicSize)):
            raise NotImplementedError(f"tpu_dynamo: {what} has a symbolic shape {tuple(t.shape)}")
        shape.append(d)
    return {"dtype": dtype_name(t.dtype), "shape": shape}


def source_line(node: torch.fx.Node) -> str | None:
    """The innermost user frame of the node's stack trace, as `file:line: code`."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = trace.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        head = lines[i].strip()
        if head.startswith('File "'):
            file, _, rest = head[len('File "'):].partition('", line ')
            lineno = rest.split(",")[0]
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{file}:{lineno}: {code}"
    return None


class _Builder:
    def __init__(
        self, gm: torch.fx.GraphModule, placeholder_kinds: list[InputKind], resolve: SizeResolver
    ) -> None:
        self.gm = gm
        self.placeholder_kinds = placeholder_kinds
        self.resolve = resolve
        # FX node -> value id (single tensor) or {tuple index: value id} (multi-output node).
        self.values: dict[torch.fx.Node, int | dict[int, int]] = {}
        # Scalar placeholders and size computations (sym_size, operator.mul on SymInts) of a
        # graph specialized per shape are baked in as literals.
        self.scalars: dict[torch.fx.Node, int | float | bool] = {}
        self.tensor_args: list[int] = []
        self.inputs: list[dict[str, Any]] = []
        self.kinds: list[InputKind] = []
        self.constants: list[torch.Tensor] = []
        self.nodes: list[dict[str, Any]] = []
        self.sources: list[str | None] = []
        # IR input -> value id of its new content, from `copy_(placeholder, value)`.
        self.mutations: dict[int, int] = {}
        self.next_value = 0
        # Symbolic graphs: SymInt placeholders' positions and `SymExpr`s.
        self.scalar_args: list[int] = []
        self.scalar_exprs: list[Any] = []
        # `(info value id, api name, is_matrix)` of every linalg error check.
        self.checks: list[tuple[int, str, bool]] = []

    def new_value(self) -> int:
        self.next_value += 1
        return self.next_value - 1

    def add_input(self, node: torch.fx.Node, ty: dict[str, Any], kind: InputKind) -> None:
        self.values[node] = len(self.inputs)
        self.inputs.append({"ty": ty, "kind": kind.value})
        self.kinds.append(kind)

    def value_of(self, node: torch.fx.Node) -> int:
        v = self.values[node]
        if v == _TOKEN:
            raise LowerError(f"tpu_dynamo: effect token {node.format_node()} used as a tensor")
        if isinstance(v, dict):
            raise LowerError(f"tpu_dynamo: multi-output node {node.format_node()} used as one tensor")
        return v

    def arg(self, a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            if a in self.scalars:
                return self.arg(self.scalars[a])
            return {"value": self.value_of(a)}
        if isinstance(a, _SYMBOLIC):
            value = self.resolve(a)
            if isinstance(value, _SYMBOLIC):
                # An unbacked value read from a tensor (`.item()`): nothing binds it.
                raise NotImplementedError(f"tpu_dynamo: data-dependent scalar {a} (no static value)")
            return self.arg(value)
        if isinstance(a, SymbolicSize):
            return {"symint": a.expr}  # a marker; `symbolic_sizes` moves it out of the graph
        if a is None:
            return "none"
        if isinstance(a, bool):
            return {"bool": a}
        if isinstance(a, int):
            return {"int": a}
        if isinstance(a, float):
            return {"float": struct.unpack("<Q", struct.pack("<d", a))[0]}
        if isinstance(a, str):
            return {"str": a}
        if isinstance(a, torch.dtype):
            return {"dtype": dtype_name(a)}
        if isinstance(a, (torch.layout, torch.memory_format, torch.device)):
            return {"str": str(a)}
        if isinstance(a, (list, tuple)):
            return {"list": [self.arg(x) for x in a]}
        raise NotImplementedError(f"tpu_dynamo: argument {a!r} of type {type(a).__name__}")

    def placeholders(self) -> None:
        phs = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        assert len(phs) == len(self.placeholder_kinds), "one kind per placeholder"
        for i, (n, kind) in enumerate(zip(phs, self.placeholder_kinds)):
            val = n.meta.get("val")
            if isinstance(n.meta.get("desc"), ForwardTokenAOTInput):
                self.values[n] = _TOKEN
                continue
            if isinstance(val, (int, float, bool, *_SYMBOLIC)):
                self.scalars[n] = self.resolve(val)
                if isinstance(self.scalars[n], SymbolicSize):
                    self.scalar_args.append(i)
                    self.scalar_exprs.append(self.scalars[n].expr)
                continue
            if kind is not InputKind.USER and not n.users:
                # A weight no node reads (one only the prep graph reads, hoist.py) is no input:
                # neither uploaded nor kept on the device.
                continue
            self.tensor_args.append(i)
            self.add_input(n, self.tensor_type(val, f"input {n.name}"), kind)
        # get_attr tensors become constant inputs after the placeholders, in graph order.
        for n in self.gm.graph.nodes:
            if n.op == "get_attr":
                t = _with_value(operator.attrgetter(n.target)(self.gm), n.target)
                self.add_input(n, self.tensor_type(t, f"constant {n.target}"), InputKind.CONSTANT)
                self.constants.append(t)
        self.next_value = len(self.inputs)

    def mutation(self, n: torch.fx.Node) -> bool:
        """Records `copy_(input, value)`, AOTAutograd's kept input mutation, as an alias.

        With `keep_inference_input_mutations` the functional graph ends in these copies; the
        executable returns `value` into the input's memory (and donated device buffer) instead.
        """
        if n.target is not torch.ops.aten.copy_.default or n.args[0].op != "placeholder":
            return False
        dst, src = n.args[:2]
        want, got = (self.tensor_type(x.meta["val"], f"copy_ into {dst.name}") for x in (dst, src))
        if want != got:
            raise NotImplementedError(f"tpu_dynamo: in-place copy_ of {got} into input {dst.name} ({want})")
        self.mutations[self.value_of(dst)] = self.value_of(src)
        self.values[n] = self.value_of(src)
        return True

    def tensor_type(self, t: Any, what: str) -> dict[str, Any]:
        return tensor_type(t, what, self.resolve)

    def call(self, n: torch.fx.Node) -> None:
        if isinstance(n.meta.get("val"), _SYMBOLIC):
            self.scalars[n] = self.resolve(n.meta["val"])
            return
        if self.mutation(n):
            return
        if n.target is operator.getitem:
            base, index = n.args
            self.values[n] = self.values[base][index]  # type: ignore[index]
            return
        if n.target is torch.ops.higher_order.with_effects:
            self.effect(n)
            return
        if not isinstance(n.target, torch._ops.OpOverload):
            raise LowerError(
                f"tpu_dynamo: {n.target} is not an ATen operator overload"
                f" (at {source_line(n) or 'unknown source'})"
            )
        val = n.meta.get("val")
        op = str(n.target)
        if isinstance(val, (tuple, list)):
            outputs, ids = [], {}
            for i, t in enumerate(val):
                if isinstance(t, torch.Tensor):
                    outputs.append(self.tensor_type(t, f"output {i} of {op}"))
                    ids[i] = self.new_value()
            self.values[n] = ids
        elif val is None:  # an op run only for its effect (`_assert_async`)
            outputs, self.values[n] = [], {}
        else:
            outputs = [self.tensor_type(val, f"output of {op}")]
            self.values[n] = self.new_value()
        kwargs = sorted((k, v) for k, v in n.kwargs.items() if k not in _DROPPED_KWARGS)
        self.nodes.append(
            {
                "op": op,
                "args": [self.arg(a) for a in n.args],
                "kwargs": [[k, self.arg(v)] for k, v in kwargs],
                "outputs": outputs,
            }
        )
        self.sources.append(source_line(n))

    def effect(self, n: torch.fx.Node) -> None:
        """`with_effects(token, op, *args)`: the token only orders side effects. The one effectful
        op linalg functions trace to, `_linalg_check_errors(info, api_name, is_matrix)`, raises on a
        nonzero `info`; `info` becomes an extra result that the wrapper checks the same way after
        the call. The new token is the old one, and like it no IR value."""
        token, op, *args = n.args
        if op is not torch.ops.aten._linalg_check_errors.default:
            raise LowerError(
                f"tpu_dynamo: with_effects of {op} is not supported (at {source_line(n) or 'unknown source'})"
            )
        info, api_name = args[:2]
        is_matrix = args[2] if len(args) > 2 else n.kwargs["is_matrix"]
        if self.values.get(token) != _TOKEN:
            raise LowerError(f"tpu_dynamo: with_effects without an effect token: {n.format_node()}")
        self.checks.append((self.value_of(info), api_name, bool(is_matrix)))
        self.values[n] = {0: _TOKEN}

    def build(self) -> Converted:
        self.placeholders()
        outs: list[int] = []
        template: list[int | None] = []
        devices: list[str] = []
        for n in self.gm.graph.nodes:
            if n.op == "call_function":
                self.call(n)
            elif n.op == "output":
                for o in n.args[0]:
                    # A number output (a size) is not the executable's: `symbolic.PerShape`
                    # returns it.
                    if o is None or self.values.get(o) == _TOKEN or o in self.scalars:
                        template.append(None)
                    else:
                        template.append(len(outs))
                        outs.append(self.value_of(o))
                        devices.append(str(getattr(o.meta.get("val"), "device", "cpu")))
            elif n.op not in ("placeholder", "get_attr"):
                raise LowerError(f"tpu_dynamo: FX node kind {n.op!r} ({n.format_node()}) is not supported")
        mutations = []
        for inp, value in sorted(self.mutations.items()):
            mutations.append((inp, len(outs)))
            outs.append(value)
        checks = []
        for value, api_name, is_matrix in self.checks:
            checks.append((len(outs), api_name, is_matrix))
            outs.append(value)
        aliases = [{"input": i, "output": o} for i, o in mutations]
        graph = {"inputs": self.inputs, "nodes": self.nodes, "outputs": outs, "aliases": aliases}
        body: dict[str, Any] = {"graph": graph, "sources": self.sources}
        if isinstance(self.resolve, SymbolNames):
            body = {"graph": body, "sizes": self.symbolic_sizes(), "scalars": self.scalar_exprs}
        return Converted(
            json.dumps(body, separators=(",", ":")),
            tuple(self.tensor_args),
            tuple(self.kinds),
            tuple(self.constants),
            tuple(template),
            tuple(mutations),
            tuple(self.scalar_args),
            tuple(checks),
            result_devices=tuple(devices),
            gpu=next((str(v.device) for n in self.gm.graph.nodes if _on_gpu(v := n.meta.get("val"))), None),
        )

    def symbolic_sizes(self) -> list[dict[str, Any]]:
        """Moves every symbolic size out of the graph into `SymbolicGraph.sizes` (`SymSize`s),
        leaving 0 in its place."""
        sizes = []
        types = [i["ty"] for i in self.inputs] + [t for n in self.nodes for t in n["outputs"]]
        for value, ty in enumerate(types):
            for d, size in enumerate(ty["shape"]):
                if isinstance(size, SymbolicSize):
                    sizes.append({"at": {"dim": {"value": value, "dim": d}}, "expr": size.expr})
                    ty["shape"][d] = 0

        def visit(a: Any, node: int, arg: int, path: list[int]) -> None:
            if isinstance(a, dict) and "symint" in a:
                sizes.append({"at": {"arg": {"node": node, "arg": arg, "path": path}}, "expr": a.pop("symint")})
                a["int"] = 0
            elif isinstance(a, dict) and "list" in a:
                for i, x in enumerate(a["list"]):
                    visit(x, node, arg, [*path, i])

        for k, n in enumerate(self.nodes):
            for i, a in enumerate([*n["args"], *(v for _, v in n["kwargs"])]):
                visit(a, k, i, [])
        return sizes


def _on_gpu(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not value.is_cpu


def _with_value(t: Any, name: str) -> Any:
    """A constant as a tensor with a value. A trace on a GPU can hold an empty one only as a
    FakeTensor (`torch.tensor([], device="cuda")`, a transformers cache layer's first keys): an
    empty host tensor stands for it, as good as any since it has no elements."""
    if not isinstance(t, FakeTensor):
        return t
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    raise NotImplementedError(
        f"tpu_dynamo: the traced graph's constant {name} ({t.dtype} {list(t.shape)} on {t.device}) has no value"
        " (a FakeTensor); make it a buffer of the module or an input"
    )


def convert(
    gm: torch.fx.GraphModule, placeholder_kinds: list[InputKind], resolve: SizeResolver = _static
) -> Converted:
    """Converts an ATen-level, functional FX graph to the graph IR.

    Shapes must be static, or symbolic with `resolve` giving every size its value for this call.
    """
    return _Builder(gm, placeholder_kinds, resolve).build()


def convert_symbolic(gm: torch.fx.GraphModule, placeholder_kinds: list[InputKind]) -> Converted:
    """Converts a graph with symbolic sizes once, to `SymbolicGraph` JSON (compiler/src/ir.rs).

    NotImplementedError if a size is not representable (float/bool symbols, data-dependent sizes).
    """
    return _Builder(gm, placeholder_kinds, SymbolNames(gm.graph.find_nodes(op="placeholder"))).build()
