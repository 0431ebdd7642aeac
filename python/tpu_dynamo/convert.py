"""ATen FX graph -> graph IR (the JSON that `compiler/src/ir.rs` deserializes).

The IR is canonical: values are numbered by position (inputs, then node outputs in graph order),
never by FX node name, and keyword arguments are sorted, so the same model yields the same
canonical bytes in every process. Source lines travel beside the graph, only for error messages.
"""
from __future__ import annotations

import json
import operator
import struct
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.fx

from ._native import LowerError

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
    """Per graph output: the index into the executable's results, or None for a None output."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise NotImplementedError(f"tpu_dynamo: dtype {dtype} is not supported") from None


def tensor_type(t: Any, what: str) -> dict[str, Any]:
    if not isinstance(t, torch.Tensor):
        raise NotImplementedError(f"tpu_dynamo: {what} is a {type(t).__name__}, not a tensor")
    shape = []
    for d in t.shape:
        if not isinstance(d, int):
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
    def __init__(self, gm: torch.fx.GraphModule, placeholder_kinds: list[InputKind]) -> None:
        self.gm = gm
        self.placeholder_kinds = placeholder_kinds
        # FX node -> value id (single tensor) or {tuple index: value id} (multi-output node).
        self.values: dict[torch.fx.Node, int | dict[int, int]] = {}
        # Scalar placeholders (sizes of a graph specialized per shape) are baked in as literals.
        self.scalars: dict[torch.fx.Node, int | float | bool] = {}
        self.tensor_args: list[int] = []
        self.inputs: list[dict[str, Any]] = []
        self.kinds: list[InputKind] = []
        self.constants: list[torch.Tensor] = []
        self.nodes: list[dict[str, Any]] = []
        self.sources: list[str | None] = []
        self.next_value = 0

    def new_value(self) -> int:
        self.next_value += 1
        return self.next_value - 1

    def add_input(self, node: torch.fx.Node, ty: dict[str, Any], kind: InputKind) -> None:
        self.values[node] = len(self.inputs)
        self.inputs.append({"ty": ty, "kind": kind.value})
        self.kinds.append(kind)

    def value_of(self, node: torch.fx.Node) -> int:
        v = self.values[node]
        if isinstance(v, dict):
            raise LowerError(f"tpu_dynamo: multi-output node {node.format_node()} used as one tensor")
        return v

    def arg(self, a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            if a in self.scalars:
                return self.arg(self.scalars[a])
            return {"value": self.value_of(a)}
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
            if isinstance(val, (int, float, bool)):
                self.scalars[n] = val
                continue
            self.tensor_args.append(i)
            self.add_input(n, tensor_type(val, f"input {n.name}"), kind)
        # get_attr tensors become constant inputs after the placeholders, in graph order.
        for n in self.gm.graph.nodes:
            if n.op == "get_attr":
                t = operator.attrgetter(n.target)(self.gm)
                self.add_input(n, tensor_type(t, f"constant {n.target}"), InputKind.CONSTANT)
                self.constants.append(t)
        self.next_value = len(self.inputs)

    def call(self, n: torch.fx.Node) -> None:
        if n.target is operator.getitem:
            base, index = n.args
            self.values[n] = self.values[base][index]  # type: ignore[index]
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
                    outputs.append(tensor_type(t, f"output {i} of {op}"))
                    ids[i] = self.new_value()
            self.values[n] = ids
        elif val is None:  # an op run only for its effect (`_assert_async`)
            outputs, self.values[n] = [], {}
        else:
            outputs = [tensor_type(val, f"output of {op}")]
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

    def build(self) -> Converted:
        self.placeholders()
        outs: list[int] = []
        template: list[int | None] = []
        for n in self.gm.graph.nodes:
            if n.op == "call_function":
                self.call(n)
            elif n.op == "output":
                for o in n.args[0]:
                    if o is None:
                        template.append(None)
                    else:
                        template.append(len(outs))
                        outs.append(self.value_of(o))
            elif n.op not in ("placeholder", "get_attr"):
                raise LowerError(f"tpu_dynamo: FX node kind {n.op!r} ({n.format_node()}) is not supported")
        graph = {"inputs": self.inputs, "nodes": self.nodes, "outputs": outs}
        text = json.dumps({"graph": graph, "sources": self.sources}, separators=(",", ":"))
        return Converted(
            text, tuple(self.tensor_args), tuple(self.kinds), tuple(self.constants), tuple(template)
        )


def convert(gm: torch.fx.GraphModule, placeholder_kinds: list[InputKind]) -> Converted:
    """Converts an ATen-level, functional FX graph with static shapes to the graph IR."""
    return _Builder(gm, placeholder_kinds).build()
