"""One ATen graph compiled for one input signature, callable with torch CPU tensors."""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.fx

from . import _native, debug
from .convert import Converted, InputKind, convert
from .options import Options

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "u8": torch.uint8,
    "i8": torch.int8,
    "i16": torch.int16,
    "i32": torch.int32,
    "i64": torch.int64,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f32": torch.float32,
    "f64": torch.float64,
    "c64": torch.complex64,
}

# Op sequence (shape-free) of every graph compiled so far; it tells "new graph" from "new shape".
_seen_op_sequences: set[tuple[str, ...]] = set()


class Executable:
    """Boxed callable AOTAutograd runs: takes the flat input list, returns the output tuple.

    Inputs of kind parameter/buffer/constant pass their `_version`, so Rust keeps their device
    buffer and re-uploads only after an in-place change; user inputs (-1) upload every call.
    """

    _boxed_call = True

    def __init__(self, native: _native.CompiledGraph, converted: Converted) -> None:
        self.native = native
        self.tensor_args = converted.tensor_args
        self.constants = converted.constants
        self.resident = tuple(k is not InputKind.USER for k in converted.kinds)
        self.template = converted.outputs
        self.out_types = [(_TORCH_DTYPES[d], tuple(s)) for d, s in native.output_types]

    def _host_inputs(self, args: list[Any]) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
        """The dense CPU tensors to keep alive during the call, and their `(ptr, nbytes, version)`."""
        tensors = [*(args[i] for i in self.tensor_args), *self.constants]
        held, ins = [], []
        for t, resident in zip(tensors, self.resident):
            if t.device.type != "cpu":
                raise ValueError(f"tpu_dynamo: inputs must be CPU tensors, got one on {t.device}")
            t = t.contiguous()
            held.append(t)
            ins.append((t.data_ptr(), t.nbytes, t._version if resident else -1))
        return held, ins

    def __call__(self, args: list[Any]) -> tuple[torch.Tensor | None, ...]:
        held, ins = self._host_inputs(args)
        args.clear()  # boxed convention: let AOTAutograd's caller free inputs early
        outs = [torch.empty(shape, dtype=dtype) for dtype, shape in self.out_types]
        self.native.run(ins, [(o.data_ptr(), o.nbytes) for o in outs])
        return tuple(None if i is None else outs[i] for i in self.template)

    def bench_execute(self, args: list[Any], n: int) -> list[float]:
        """Seconds per bare PJRT execute on `args` (a call's inputs, uploaded once), `n` times."""
        _held, ins = self._host_inputs(args)
        return self.native.bench_execute(ins, n)


def compile_graph(gm: torch.fx.GraphModule, kinds: list[InputKind], options: Options) -> Executable:
    """Converts, lowers and compiles one ATen graph with static shapes (or finds it cached in
    memory or on disk)."""
    start = time.perf_counter()
    converted = convert(gm, kinds)
    native = _native.compile(converted.json, need_stablehlo=debug.wanted(options))
    code = gm.code
    ops = tuple(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    if native.memory_hit:
        debug.log.info("%s: reused a compiled executable from memory", options.name or "graph")
    elif native.disk_hit:
        debug.log.info(
            "%s: loaded a compiled executable from the disk cache in %.1f ms",
            options.name or "graph",
            (time.perf_counter() - start) * 1e3,
        )
    else:
        reason = "new shape" if ops in _seen_op_sequences else "new graph"
        debug.log.info(
            "%s: compiled (%s) in %.1f ms (%d ops)",
            options.name or "graph",
            reason,
            (time.perf_counter() - start) * 1e3,
            len(ops),
        )
    _seen_op_sequences.add(ops)
    debug.report(options, fx_code=code, stablehlo=native.stablehlo, graph_hash=native.graph_hash)
    return Executable(native, converted)
