"""One ATen graph compiled for one input signature, callable with torch CPU tensors (and CUDA
tensors on a GPU plugin)."""
from __future__ import annotations

import contextlib
import math
import operator
import time
from typing import Any, NamedTuple

import torch
import torch.fx

from . import _native, debug
from .convert import Converted, InputKind, SizeResolver, convert
from .hoist import convert_hoisted
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

# `torch.from_dlpack` for a capsule, without the checks it makes first for objects that have
# `__dlpack__` (1-2 µs per result, on every call).
_from_dlpack = torch._C._from_dlpack

# Op sequence (shape-free) of every graph compiled so far; it tells "new graph" from "new shape".
_seen_op_sequences: set[tuple[str, ...]] = set()

_data_ptr = torch.Tensor.data_ptr
_version = operator.attrgetter("_version")


class Unchanged(NamedTuple):
    """Tensors as one call found them: the objects, their addresses and versions, asked again on
    every call for all of them at once, in C loops (`map`) rather than a Python loop per tensor.
    A tiny Llama's inputs (`Executable._host_inputs`, warm): at batch 8, 27 parameters and the
    input ids, 12.0 → 8.5 µs; a decode step's 26 parameters and 10 changing inputs, 14.3 → 11.2."""

    tensors: tuple[torch.Tensor, ...]
    ptrs: list[int]
    versions: list[int]

    @staticmethod
    def of(tensors: tuple[torch.Tensor, ...]) -> Unchanged:
        """`tensors` as they are now (none an inference tensor: those have no version)."""
        return Unchanged(tensors, list(map(_data_ptr, tensors)), list(map(_version, tensors)))

    def holds(self, tensors: tuple[torch.Tensor, ...]) -> bool:
        """Whether `tensors` are the same objects, at the same addresses and versions."""
        return (
            all(map(operator.is_, tensors, self.tensors))
            and list(map(_data_ptr, tensors)) == self.ptrs
            and list(map(_version, tensors)) == self.versions
        )


def _picker(indices: tuple[int, ...]) -> Any:
    """`seq -> tuple(seq[i] for i in indices)`, as one C call where there are several."""
    if len(indices) > 1:
        return operator.itemgetter(*indices)
    return lambda seq: tuple(seq[i] for i in indices)


class CallSizes(NamedTuple):
    """The sizes of one call's tensors where they differ from the executable's: `given`,
    `(input, dims, packed)` of inputs it pads; `cut`, `(output, dims, packed)` of results it
    cuts back (a bucket's executable, symbolic.py); `packed`: the tensor is the prefix of the
    executable's buffer rather than its corner (`_native.SymbolicGraph.specialize`). Per
    output: whether it is handed over, and its bytes; where every one is (a CPU plugin's
    results, most graphs), the native run's `out_memory` (none of ours), built once here: a
    call then neither lists its outputs' memory nor asks each whether it is handed over.
    `shape`: `given` and `cut` as the native run reads them (None at the executable's sizes)."""

    given: list[tuple[int, list[int], bool]]
    cut: list[tuple[int, list[int], bool]]
    handed: list[bool]
    out_nbytes: list[int]
    all_handed: list[tuple[int, int]] | None
    shape: _native.CallShape | None

    @staticmethod
    def of(
        given: list[tuple[int, list[int], bool]],
        cut: list[tuple[int, list[int], bool]],
        handed: list[bool],
        out_nbytes: list[int],
        shape: _native.CallShape | None = None,
    ) -> CallSizes:
        return CallSizes(given, cut, handed, out_nbytes, [(0, n) for n in out_nbytes] if all(handed) else None, shape)


class Executable:
    """Boxed callable AOTAutograd runs: takes the flat input list, returns the output tuple.

    Inputs of kind parameter/buffer/constant pass their `_version`, so Rust keeps their device
    buffer and re-uploads only after an in-place change; user inputs (-1) upload every call.
    """

    _boxed_call = True

    def __init__(
        self, native: _native.CompiledGraph, converted: Converted, caller_bumps: frozenset[int] = frozenset()
    ) -> None:
        self.native = native
        self.converted = converted
        self.tensor_args = converted.tensor_args
        self.args_of = _picker(converted.tensor_args)
        self.number_args = converted.number_args
        self.constants = converted.constants
        self.mutations = converted.mutations
        # Mutated inputs whose version we bump ourselves (AOTAutograd bumps the others).
        self.bump = tuple(i for i, _ in self.mutations if converted.tensor_args[i] not in caller_bumps)
        mutated = {i for i, _ in self.mutations}
        # A mutated input's new value stays on the device, so it is resident whatever its kind.
        self.resident = tuple(k is not InputKind.USER or i in mutated for i, k in enumerate(converted.kinds))
        # Per resident input: the tensor the last call kept, and its `(ptr, nbytes, version)`.
        self.last_kept: list[tuple[torch.Tensor, tuple[int, int, int]] | None] = [None] * len(self.resident)
        # Resident inputs no call changes (parameters, buffers, constants), asked together
        # (`Unchanged`); the others (user inputs, mutated ones) one by one.
        steady = tuple(i for i, k in enumerate(converted.kinds) if k is not InputKind.USER and i not in mutated)
        self.steady_of = _picker(steady)
        self.changing = tuple(i for i in range(len(self.resident)) if i not in steady)
        # The steady inputs as the last call kept them, and that call's keys (theirs reused).
        self.kept_steady: tuple[Unchanged, list[Any]] | None = None
        self.template = converted.outputs
        # Whether the graph's outputs are the executable's results as they come (most graphs).
        self.in_order = self.template == tuple(range(len(native.output_types)))
        self.checks = converted.checks
        self.out_types = [(_TORCH_DTYPES[d], tuple(s)) for d, s in native.output_types]
        self.in_shapes = [tuple(s) for _, s in native.input_types]
        # A graph traced on a GPU: where it runs, and which results go back to the host.
        self.gpu = None if converted.gpu is None else torch.device(converted.gpu)
        self.host_results = tuple(o for o, d in enumerate(converted.result_devices) if d == "cpu")
        self.out_nbytes = [math.prod(s) * d.itemsize for d, s in self.out_types]
        # Results the plugin hands over as the tensors' storage (CPU plugins) instead of copying
        # them into tensors allocated here; a mutated input's result goes into the input itself.
        aliased = {o for _, o in self.mutations}
        handed = [native.hands_over_outputs and n > 0 and o not in aliased for o, n in enumerate(self.out_nbytes)]
        self.exact = CallSizes.of([], [], handed, self.out_nbytes)
        self.derived = None if converted.prep is None else Derived(converted.prep, converted.prep_args)

    def resized(
        self,
        given: dict[int, list[int]],
        cut: dict[int, list[int]],
        packed: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset()),
    ) -> CallSizes:
        """A call's sizes with inputs `given` smaller than the executable's and results `cut`
        to smaller sizes, `packed` (inputs, outputs) in the packed layout; the native run hands
        the cut results over (a packed one in the executable's own buffer, where the host can
        address it; the others in memory of their own)."""
        given_at = [(i, dims, i in packed[0]) for i, dims in given.items()]
        cut_to = [(o, dims, o in packed[1]) for o, dims in cut.items()]
        return CallSizes.of(
            given_at,
            cut_to,
            [h or o in cut for o, h in enumerate(self.exact.handed)],
            [
                math.prod(cut[o]) * dtype.itemsize if o in cut else n
                for o, ((dtype, _), n) in enumerate(zip(self.out_types, self.out_nbytes))
            ],
            self.native.shaped(given_at, cut_to),
        )

    def _tensors(self, args: list[Any]) -> list[torch.Tensor]:
        """The executable's inputs: the call's tensors, the graph's constants, and its numbers as
        (host) tensors."""
        tensors = [*self.args_of(args), *self.constants]
        if self.number_args:
            at = len(self.tensor_args)
            tensors[at:at] = [torch.tensor(args[i], dtype=torch.int64) for i in self.number_args]
        return tensors

    def _host_inputs(
        self, args: list[Any]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[int, int, int]]]:
        """The call's input tensors, their dense versions to keep alive during the call, and
        those dense tensors' `(ptr, nbytes, version)`.

        Steady inputs that are the tensors the last call kept, at the same addresses and
        versions, are dense on the CPU as they were (Dynamo's guards pin their sizes and
        strides; `set_` and other in-place changes bump their version), so a call asks them
        only that, all at once; the rest are asked one by one (`_ask`)."""
        tensors = self._tensors(args)
        held = tensors.copy()
        steady = self.steady_of(tensors)
        kept = self.kept_steady
        ins: list[Any]
        if kept is not None and kept[0].holds(steady):
            ins = kept[1].copy()
            self._ask(tensors, self.changing, held, ins)
            return tensors, held, ins
        ins = [None] * len(tensors)
        self._ask(tensors, range(len(tensors)), held, ins)
        # Kept only where every steady input is kept resident as it is (a version, see `_ask`);
        # the changing inputs' keys in the copy are overwritten on every call.
        versioned = all(key[2] >= 0 for key in self.steady_of(ins))
        self.kept_steady = (Unchanged.of(steady), ins.copy()) if versioned else None
        return tensors, held, ins

    def _ask(self, tensors: list[torch.Tensor], indices: Any, held: list[Any], ins: list[Any]) -> None:
        """Fills `held` and `ins` (see `_host_inputs`) at `indices`, asking each tensor only what
        it must: a resident input that is the tensor the last call kept, at the same address
        and version, only those; otherwise `is_cpu` (5x cheaper than `device.type`), and only
        resident inputs `is_inference`."""
        last_kept = self.last_kept
        for i in indices:
            t = tensors[i]
            resident = self.resident[i]
            if resident:
                kept = last_kept[i]
                if kept is not None and kept[0] is t and t.data_ptr() == kept[1][0] and t._version == kept[1][2]:
                    ins[i] = kept[1]
                    continue
            if not t.is_cpu:
                raise ValueError(f"tpu_dynamo: inputs must be CPU tensors, got one on {t.device}")
            c = t.contiguous()
            held[i] = c
            # A mutated input that is not dense gets a dense copy, and an inference tensor has no
            # version counter: neither can be kept resident.
            keep = resident and c is t and not t.is_inference()
            key = (c.data_ptr(), c.nbytes, t._version if keep else -1)
            ins[i] = key
            if keep:
                last_kept[i] = (t, key)

    def __call__(self, args: list[Any], sizes: CallSizes | None = None) -> tuple[torch.Tensor | None, ...]:
        if self.derived is not None:
            args.extend(self.derived(args))
        if self.gpu is not None:
            tensors = self._tensors(args)
            args.clear()
            return self._on_gpu(tensors, sizes)
        tensors, held, ins = self._host_inputs(args)
        args.clear()  # boxed convention: let AOTAutograd's caller free inputs early
        s = self.exact if sizes is None else sizes
        outs: list[Any]
        if s.all_handed is not None:
            outs, out_memory = [None] * len(s.handed), s.all_handed
        else:
            outs = [
                None if handed else torch.empty(shape, dtype=dtype)
                for handed, (dtype, shape) in zip(s.handed, self.out_types)
            ]
            for i, o in self.mutations:
                outs[o] = held[i]
            out_memory = [(0 if o is None else o.data_ptr(), n) for o, n in zip(outs, s.out_nbytes)]
        movable = [i for i, _ in self.mutations if held[i] is tensors[i] and _movable(tensors[i])]
        in_place, handed = self.native.run(held, ins, out_memory, movable, s.shape)
        for o, capsule in handed:
            outs[o] = _from_dlpack(capsule)
        if self.mutations:
            self._commit_mutations(tensors, held, in_place)
        for i, api_name, is_matrix in self.checks:
            torch.ops.aten._linalg_check_errors(outs[i], api_name, is_matrix=is_matrix)
        if self.in_order:
            return tuple(outs)
        return tuple(None if i is None else outs[i] for i in self.template)

    def _on_gpu(self, tensors: list[torch.Tensor], sizes: CallSizes | None) -> tuple[torch.Tensor | None, ...]:
        """`__call__` for a graph traced on a GPU, which a GPU plugin runs there."""
        if self.gpu.type != "cuda":
            raise ValueError(f"tpu_dynamo: inputs must be CPU or CUDA tensors, got one on {self.gpu}")
        if self.native.hands_over_outputs:
            raise ValueError(
                "tpu_dynamo: the inputs are CUDA tensors, but the PJRT plugin in use computes on the host"
                " (XLA:CPU); for a GPU install the XLA CUDA plugin (`pip install jax-cuda13-pjrt`, or point"
                " TPU_DYNAMO_PJRT_PLUGIN at its xla_cuda_plugin.so), or move the model and its inputs to the CPU"
            )
        return self._on_device(tensors, sizes, self.gpu)

    def _on_device(
        self, tensors: list[torch.Tensor], sizes: CallSizes | None, device: torch.device
    ) -> tuple[torch.Tensor | None, ...]:
        """`__call__` for inputs in a GPU's memory (CUDA tensors on `device`; a GPU plugin): they
        are read where they are, the results stay in the GPU's memory, and nothing crosses the
        host. Inputs `given` smaller than the executable's are padded here, and results `cut`, on
        the device; an input the executable updates goes in as a copy (the execute may write into
        what it is given) whose new value is copied back. With a CPU `device` (tests, a CPU
        plugin) the same path runs on the host."""
        s = self.exact if sizes is None else sizes
        padded = {i: (self.in_shapes[i], packed) for i, _, packed in s.given}
        updated = {i for i, _ in self.mutations}
        # Per input on every call: `is_cpu`/`is_cuda` and `get_device` cost less than `device`.
        on_host, index = device.type == "cpu", device.index or 0
        held, ins = [], []
        for i, (t, resident) in enumerate(zip(tensors, self.resident)):
            viewed = t.is_cpu if on_host else t.is_cuda and t.get_device() == index
            if not (viewed or t.is_cpu):
                raise ValueError(f"tpu_dynamo: inputs on two devices in one call ({device} and {t.device})")
            if i in padded:
                c = _padded(t, *padded[i])
            else:
                c = t.clone(memory_format=torch.contiguous_format) if i in updated else t.contiguous()
            held.append(c)
            # A view reads the memory as it is at each execute, so an in-place change needs no new
            # one: a view is kept by address alone (version 0), an inference tensor's too.
            if resident and c is t and (viewed or not t.is_inference()):
                version = 0 if viewed else t._version
            else:
                version = -1
            ins.append((c.data_ptr(), c.nbytes, version, viewed))
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        capsules = self.native.run_on_device(held, ins, index)
        outs: list[Any] = [
            torch.empty(shape, dtype=dtype, device=device) if c is None else _from_dlpack(c).to(device)
            for c, (dtype, shape) in zip(capsules, self.out_types)
        ]
        for o, dims, packed in s.cut:
            outs[o] = _cut(outs[o], dims, packed)
        if device.type != "cpu":
            for o in self.host_results:
                outs[o] = outs[o].cpu()
        for i, o in self.mutations:
            t = tensors[i]
            keep = contextlib.nullcontext() if t.is_inference() else torch.autograd._unsafe_preserve_version_counter(t)
            with keep:
                t.copy_(outs[o])
            outs[o] = t
        torch.autograd.graph.increment_version([tensors[i] for i in self.bump if not tensors[i].is_inference()])
        for i, api_name, is_matrix in self.checks:
            torch.ops.aten._linalg_check_errors(outs[i], api_name, is_matrix=is_matrix)
        if self.in_order:
            return tuple(outs)
        return tuple(None if i is None else outs[i] for i in self.template)

    def bench_execute(self, args: list[Any], n: int, sizes: CallSizes | None = None) -> list[float]:
        """Seconds per bare PJRT execute on `args` (a call's inputs, at `sizes`, uploaded once),
        `n` times."""
        if self.derived is not None:
            args = [*args, *self.derived(args)]
        # Inputs in a GPU's memory go through the host once: the upload puts them on the device.
        args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        _tensors, held, ins = self._host_inputs(args)
        return self.native.bench_execute(held, ins, n, (sizes or self.exact).shape)

    def _commit_mutations(
        self, tensors: list[torch.Tensor], held: list[torch.Tensor], in_place: list[tuple[int, Any]]
    ) -> None:
        """Makes each mutated input observe its new value.

        Rust either wrote it into `held[i]`, or (`in_place`, only for `_movable` tensors) left it
        in the executable's own host-addressable memory, handed over as a DLPack capsule: the
        tensor is re-pointed at that memory, so later steps update it where it is, with no copy
        either way.
        A dense input's version must then go up exactly once, as for an in-place op, so caches
        keyed on versions (ours included: Rust kept the new device buffer as version + 1) see
        the change. AOTAutograd's wrapper bumps the mutations it tracks; we bump the rest. A
        non-dense input gets the dense copy copied back (not kept resident).
        """
        for i, capsule in in_place:
            t = tensors[i]
            # An inference tensor has no version to preserve (and needs no bump).
            keep = contextlib.nullcontext() if t.is_inference() else torch.autograd._unsafe_preserve_version_counter(t)
            with keep:
                t.set_(_from_dlpack(capsule).untyped_storage(), 0, t.shape, t.stride())
        for i, _ in self.mutations:
            if held[i] is not tensors[i]:
                tensors[i].copy_(held[i])
        torch.autograd.graph.increment_version(
            [tensors[i] for i in self.bump if held[i] is tensors[i] and not tensors[i].is_inference()]
        )


def _padded(t: torch.Tensor, shape: tuple[int, ...], packed: bool) -> torch.Tensor:
    """`t` zero-padded to `shape`: as its corner, or `packed` as its leading elements."""
    full = torch.zeros(shape, dtype=t.dtype, device=t.device)
    if packed:
        full.view(-1)[: t.numel()].copy_(t.reshape(-1))
    else:
        full[tuple(slice(0, d) for d in t.shape)].copy_(t)
    return full


def _cut(t: torch.Tensor, dims: list[int], packed: bool) -> torch.Tensor:
    """`t` cut to `dims`: its leading elements (`packed`, a view), else its corner (dense)."""
    if packed:
        return t.view(-1)[: math.prod(dims)].view(dims)
    return t[tuple(slice(0, d) for d in dims)].contiguous()


class Derived:
    """A graph's values computed from weights alone (hoist.py), kept while the weights are the
    same tensors at the same addresses and versions (`Unchanged`); their storages are kept alive
    with the values so that no other tensor can take their address meanwhile."""

    def __init__(self, prep: Converted, args: tuple[int, ...]) -> None:
        self.prep = Executable(_native.compile(prep.json), prep)
        self.args_of = _picker(args)
        self.kept: Unchanged | None = None
        self.storages: list[torch.UntypedStorage] = []
        self.values: tuple[torch.Tensor, ...] = ()
        self.warned = False

    def __call__(self, args: list[Any]) -> tuple[torch.Tensor, ...]:
        inputs = self.args_of(args)
        if self.kept is not None and self.kept.holds(inputs):
            return self.values
        # An inference tensor has no version: its values are computed again on every call.
        unversioned = any(t.is_inference() for t in inputs)
        if unversioned and not self.warned:
            self.warned = True
            debug.log.warning(
                "%d values computed from weights alone are computed again on every call: the weights"
                " are inference tensors (made under torch.inference_mode()), which have no version to"
                " tell a change by; build or load the model outside inference_mode to compute them once",
                len(self.prep.out_types),
            )
        self.storages = [t.untyped_storage() for t in inputs]
        # Tensors with a version of their own, which the graph keeps resident.
        with torch.inference_mode(False):
            self.values = self.prep(list(inputs))  # type: ignore[assignment]
        self.kept = None if unversioned else Unchanged.of(inputs)
        return self.values


def _movable(t: torch.Tensor) -> bool:
    """Whether `t` may get a new storage: nothing else shares its storage (a view of it would
    keep the old value), the storage is exactly `t`, and autograd does not track it. An
    inference tensor qualifies inside inference mode (outside, torch forbids changing it)."""
    if t.is_inference() and not torch.is_inference_mode_enabled():
        return False
    storage = t.untyped_storage()
    return (
        torch._C._storage_Use_Count(storage._cdata) == 2  # `t` and `storage`
        and t._base is None
        and storage.nbytes() == t.nbytes
        and not t.requires_grad
    )


def compile_graph(
    gm: torch.fx.GraphModule,
    kinds: list[InputKind],
    options: Options,
    caller_bumps: frozenset[int] = frozenset(),
    resolve: SizeResolver | None = None,
) -> Executable:
    """Converts, lowers and compiles one ATen graph for one input signature (or finds it cached
    in memory or on disk).

    `caller_bumps`: placeholders whose version the caller bumps after a call that mutates them.
    `resolve`: the concrete value of each symbolic size, for a graph traced with symbolic shapes.
    """
    start = time.perf_counter()
    converted = convert_hoisted(gm, kinds, options) if resolve is None else convert(gm, kinds, resolve)
    native = _native.compile(converted.json, need_stablehlo=debug.wanted(options))
    return wrap(native, op_sequence(gm), gm.code, converted, options, caller_bumps, start)


def op_sequence(gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """The graph's ops in order, shape-free: it tells "new graph" from "new shape"."""
    return tuple(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def wrap(
    native: _native.CompiledGraph,
    ops: tuple[str, ...],
    fx_code: str,
    converted: Converted,
    options: Options,
    caller_bumps: frozenset[int],
    start: float,
) -> Executable:
    """Logs and reports how `native` (compiled from the FX graph `fx_code` of `ops`, starting at
    `start`) was obtained."""
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
    debug.report(options, fx_code=fx_code, stablehlo=native.stablehlo, graph_hash=native.graph_hash)
    return Executable(native, converted, caller_bumps)
