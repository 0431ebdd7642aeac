"""Type stubs for the Rust extension `tpu_dynamo._native`."""
from collections.abc import Sequence
from typing import Any

__version__: str

class LowerError(RuntimeError):
    """An ATen graph could not be lowered to StableHLO (names the op, argument types, source)."""

class PjrtError(RuntimeError):
    """The PJRT plugin failed (compile, transfer or execute)."""

class PluginNotFoundError(PjrtError):
    """No PJRT plugin could be found or loaded."""

class CallShape:
    """A call's sizes against one executable (`CompiledGraph.shaped`)."""

class CompiledGraph:
    """A graph compiled for one concrete input signature."""

    @property
    def graph_hash(self) -> str: ...
    @property
    def memory_hit(self) -> bool: ...
    @property
    def disk_hit(self) -> bool: ...
    @property
    def flops(self) -> float:
        """One execute's arithmetic, roughly: two per multiply-add of matrix products,
        convolutions and attention, one per output element of other ops."""
    @property
    def stablehlo(self) -> str | None:
        """None after a disk cache hit unless compile() was called with need_stablehlo=True."""
    @property
    def input_types(self) -> list[tuple[str, list[int]]]: ...
    @property
    def output_types(self) -> list[tuple[str, list[int]]]: ...
    @property
    def hands_over_outputs(self) -> bool:
        """Results can become host tensors as they are (the plugin computes in host memory)."""
    @property
    def temp_bytes(self) -> int:
        """Bytes of scratch one execute takes beyond its inputs and outputs (the plugin's count)."""
    def run(
        self,
        tensors: list[Any],
        inputs: Sequence[tuple[int, int, int]],
        outputs: Sequence[tuple[int, int]],
        movable: Sequence[int],
        shape: CallShape | None = None,
    ) -> tuple[list[tuple[int, Any]], list[tuple[int, Any]]]:
        """tensors: the dense input tensors (a resident copy keeps its storage alive);
        inputs: their (data_ptr, nbytes, version or -1); outputs: (data_ptr, nbytes), or (0, nbytes)
        for a result to hand over; movable: updated inputs whose tensor may be re-pointed;
        shape: the call's sizes where they are not the executable's (`shaped`). Returns (input
        index, DLPack capsule) for those left in the executable's memory and (output index,
        DLPack capsule) for the handed-over results. Unsafe on raw pointers: call it only
        through `tpu_dynamo.executable.Executable`."""
    def shaped(
        self,
        given: Sequence[tuple[int, Sequence[int], bool]],
        cut: Sequence[tuple[int, Sequence[int], bool]],
    ) -> CallShape:
        """Sizes for `run` and `bench_execute`, read once: given, (input, dims, packed) of inputs
        smaller than the executable's, zero-padded to them (packed: their bytes first, read
        where they lie if they start a large enough executable buffer); cut, (output, dims,
        packed) of results handed over cut to smaller sizes (packed: the prefix of the result
        buffer, handed over in place)."""
    def run_on_device(
        self,
        tensors: list[Any],
        inputs: Sequence[tuple[int, int, int, bool]],
        device_id: int,
    ) -> list[Any | None]:
        """A call on a GPU plugin: inputs (data_ptr, nbytes, version or -1, in the memory of CUDA
        device `device_id`) are read where they are, host ones uploaded; one DLPack capsule per
        output (None for an empty one). The caller synchronizes torch's stream first and passes
        inputs the executable updates as copies of their own."""
    def bench_execute(
        self,
        tensors: list[Any],
        inputs: Sequence[tuple[int, int, int]],
        n: int,
        shape: CallShape | None = None,
    ) -> list[float]:
        """Seconds per bare PJRT execute, `n` times, inputs uploaded once (as for `run`, inputs
        given smaller in `shape` uploaded padded)."""
    def warm_up(self) -> None:
        """Starts the first execute, on zeros, in the background where the plugin computes in
        host memory and the execute is cheap enough to hide (the first execute pays XLA's
        one-time setup); the first `run` waits for it."""

MLIR_VERSION: str
"""The LLVM/MLIR release the compiler links."""
COMPILER_SOURCE_HASH: str
"""blake3 of the lowering rules' sources; part of every executable's cache key."""

def compile(graph_json: str, need_stablehlo: bool = False) -> CompiledGraph: ...
def compile_in_background(graph_json: str) -> Loading:
    """compile() and a first execute on zeros (warm_up) on a thread of its own."""

class Loading:
    """A graph being obtained by compile_in_background()."""

    def result(self) -> CompiledGraph:
        """Waits for it; raises what compile() would have raised. Once only."""

def finish_background_work() -> None:
    """Waits until no warm-up or background load runs (called at exit)."""

def canonical_bytes(graph_json: str) -> bytes: ...
def graph_hash(graph_json: str) -> str: ...
def stats() -> dict[str, int | float]: ...
def reset_stats() -> None: ...
def supported_ops() -> list[str]: ...
def device_info() -> dict[str, str | list[str] | bool]:
    """The plugin, platform and devices in use; `host_kernels`, our kernels it runs; `amx`,
    whether our f32 products run on AMX tiles; `bf16_products`, whether our bf16 product and
    attention kernels run (on AMX tiles, or on AVX-512 BF16's vector dot products)."""
def cache_info() -> dict[str, str | int | None]:
    """The disk cache as configured now: dir, mode, max_bytes, entries and bytes (executables),
    graphs and graph_bytes (converted graphs), warning."""

def cache_list() -> list[tuple[str, str, int, float]]:
    """Executables: (key hex, path, bytes, last used as Unix seconds), most recently used first."""

def cache_clear() -> int:
    """Removes every entry (executables and converted graphs), returning how many; OSError when
    read-only."""

def graph_get(key: bytes) -> bytes | None:
    """The converted graph stored under a 32-byte key (graph_cache.py), or None."""

def graph_put(key: bytes, payload: bytes) -> None:
    """Stores a converted graph under a 32-byte key; a failed write is logged, not raised."""

def plugin_identity() -> dict[str, str]:
    """What disk cache entries made by this process are bound to."""

class SymbolicGraph:
    """A graph with symbolic sizes (`SymbolicGraph` JSON from `convert.convert_symbolic`), parsed
    once. ValueError if malformed or if a symbol could never be bound from a call's inputs."""

    def __init__(self, graph_json: str) -> None: ...
    @property
    def graph_hash(self) -> str:
        """blake3 of the symbolic IR without source lines; equal across processes."""
    @property
    def input_symbols(self) -> list[list[tuple[int, int]]]:
        """Per graph input, its `(dimension, symbol)` pairs: the sizes a call binds."""
    def fix(self, values: Sequence[tuple[int, int]]) -> SymbolicGraph:
        """This graph with the symbols of `values` (`(symbol, value)`) written in as static
        sizes: its own padding plan pads only the others."""
    @property
    def number_scalars(self) -> list[int]:
        """The scalars (positions among them) used only as numbers, which the executable can
        read at run time (`numbers_at`) instead of having their values written in."""
    def specialize(
        self,
        shapes: Sequence[Sequence[int]],
        scalars: Sequence[int],
        lengths_at: int | None = None,
        numbers_at: int | None = None,
        need_stablehlo: bool = False,
    ) -> CompiledGraph:
        """The graph for inputs of these shapes (one per graph input) and SymInt scalars,
        compiled or found in the memory/disk cache; ValueError if they contradict the graph.
        With `lengths_at`, the shapes are padded per `padding_plan`, and one 0-d int64 input
        per runtime symbol of the plan (its true size) goes in before input `lengths_at`; the
        inputs and outputs padded along one dimension only are packed (their true elements
        first, in their own order). With `numbers_at`, each of `number_scalars` is a 0-d int64
        input before input `numbers_at`."""
    def padding_plan(
        self,
    ) -> tuple[
        list[list[tuple[int, int]]],
        list[list[tuple[int, int, int]]],
        list[int | None],
        list[tuple[int, int]],
        list[int],
        list[tuple[int, int]],
        list[tuple[int, int, int]],
        list[tuple[int, int]],
        list[int],
        list[int],
    ]:
        """How to run on inputs padded to buckets: per input its `(dim, symbol)` pairs, per
        output its `(dim, symbol, plus)` cuts to the true size + plus, per scalar its symbol,
        `(symbol, limit)` caps, the symbols whose true sizes are extra inputs, the symbol pairs
        the plan assumes equal, the `(a, b, plus)` it assumes `a >= b + plus` of and the
        `(symbol, limit)` it assumes at most `limit`, and the inputs and outputs passed packed
        (padded along one dimension only). ValueError naming the op that makes padding unsafe."""
