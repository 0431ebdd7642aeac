"""Type stubs for the Rust extension `tpu_dynamo._native`."""
from collections.abc import Sequence

__version__: str

class LowerError(RuntimeError):
    """An ATen graph could not be lowered to StableHLO (names the op, argument types, source)."""

class PjrtError(RuntimeError):
    """The PJRT plugin failed (compile, transfer or execute)."""

class PluginNotFoundError(PjrtError):
    """No PJRT plugin could be found or loaded."""

class CompiledGraph:
    """A graph compiled for one concrete input signature."""

    @property
    def graph_hash(self) -> str: ...
    @property
    def memory_hit(self) -> bool: ...
    @property
    def stablehlo(self) -> str: ...
    @property
    def input_types(self) -> list[tuple[str, list[int]]]: ...
    @property
    def output_types(self) -> list[tuple[str, list[int]]]: ...
    def run(
        self, inputs: Sequence[tuple[int, int, int]], outputs: Sequence[tuple[int, int]]
    ) -> None:
        """inputs: (data_ptr, nbytes, version or -1); outputs: (data_ptr, nbytes). Unsafe on
        raw pointers: call it only through `tpu_dynamo.executable.Executable`."""
    def bench_execute(self, inputs: Sequence[tuple[int, int, int]], n: int) -> list[float]:
        """Seconds per bare PJRT execute, `n` times, inputs uploaded once (as for `run`)."""

def compile(graph_json: str) -> CompiledGraph: ...
def canonical_bytes(graph_json: str) -> bytes: ...
def graph_hash(graph_json: str) -> str: ...
def stats() -> dict[str, int | float]: ...
def reset_stats() -> None: ...
def supported_ops() -> list[str]: ...
def device_info() -> dict[str, str | list[str]]: ...
