"""Dynamo's caching precompile for backend="tpu": a new process neither traces nor compiles.

With `torch._dynamo.config.caching_precompile = True` (or `TORCH_CACHING_PRECOMPILE=1`) Dynamo
keeps each compiled frame (bytecode and guards), and `torch.compiler.save_cache_artifacts()`
writes it to Dynamo's disk cache together with one artifact per backend call. A later process
with the same setting loads the frame when the function is compiled and calls the artifacts
instead of tracing. Ours is the converted graph: its executable is found in our disk cache, on
another thread while Dynamo builds the frame's guards (`Loading`), so the first call only checks
guards and runs.

Stored are the graphs the backend already calls without AOTAutograd's runtime wrapper
(`direct.wrapper_free`): nothing of AOTAutograd is needed to call them again. A graph with
symbolic sizes (a dynamic-cache decode step) is stored as its `symbolic.Traced`, and each of its
executables is found in our disk cache at its first call of a signature. For any other
graph no artifact is recorded, so Dynamo stores no entry for its frame and traces it as before.
Nor for a frame Dynamo could not load again (`_reloadable`).

Importing this module repairs three bugs of torch 2.15's packages that made every decorated model
forward (transformers' and diffusers' are) fail to load (`_repair_dynamo_packages`), and any
transformers model from 5.25 on go unsaved (`_repair_local_class_guards`). It also has a loaded
frame's guards built once instead of twice (`_build_loaded_guards_once`).
"""
from __future__ import annotations

import dataclasses
import functools
import pickle
import sys
import types
from typing import Any

import torch
from torch._dynamo import codegen, guards, package
from torch._dynamo.precompile_context import BackendCacheArtifact, PrecompileContext
from torch._dynamo.symbolic_convert import InstructionTranslator

from . import _native
from .convert import Converted
from .direct import found
from .symbolic import Traced


def record(backend_id: str | None, graph: Converted | Traced) -> None:
    """Records `graph`, called without AOTAutograd's wrapper (direct.py), as the artifact of
    Dynamo's backend call `backend_id` (set on the graph Dynamo hands the backend only under
    caching precompile): a converted graph, or a symbolic graph's `Traced`."""
    if backend_id is None or not _reloadable():
        return
    PrecompileContext.record_artifact(TpuArtifact(key=backend_id, content=pickle.dumps(graph)))


def _reloadable() -> bool:
    """Whether Dynamo can reattach the frame being compiled in a later process. Unrepaired, it
    installs the saved graph into the module named by the function's `__module__` while the
    frame's code reads the globals it was defined with, and a wrapper made with `functools.wraps`
    in another module has the wrapped function's `__module__`: its saved frame would fail to load
    with a `NameError`, so it is traced again instead."""
    if _REPAIRED:
        return True
    tx = InstructionTranslator.current_tx()
    fn = getattr(getattr(tx, "package", None), "_innermost_fn", None)
    scope = getattr(fn, "__globals__", {}).get("__name__")
    return fn is None or scope is None or fn.__module__ == scope


def _repair_dynamo_packages() -> bool:
    """Makes a saved frame of a decorated function loadable (torch 2.15; also for Inductor's).

    1. `CompilePackage` records the compiled function under its `__module__`, and a new process
       installs the frame's graphs and guards' globals into that module. A `functools.wraps`
       wrapper defined elsewhere (transformers' `can_return_tuple`, diffusers' decorators) copies
       the wrapped function's `__module__`, but its code reads its own module's globals: the
       module named by `__globals__["__name__"]`, which resume functions already use.
    2. Dynamo reaches a module the frame's globals do not name (`collections`, to rebuild a
       model's `OrderedDict` output) through a global installed under the module object's id,
       which the package does not save: the loaded bytecode then fails on that name. Recorded
       now as one of the package's import aliases, which a loading process binds again.

    Returns False, leaving torch as it is, where these internals are not the ones repaired."""
    add_function = getattr(package.CompilePackage, "_add_function", None)
    load_module = getattr(codegen.PyCodegen, "create_load_python_module", None)
    if add_function is None or load_module is None or not all(
            hasattr(package.CompilePackage, name) for name in ("add_import_source", "current_entry")):
        return False

    def _add_function(self: Any, python_code: types.CodeType, python_module: str, *args: Any, **kwargs: Any) -> None:
        fn = getattr(self, "_innermost_fn", None)
        scope = getattr(fn, "__globals__", {}).get("__name__")
        if fn is not None and python_code is fn.__code__ and isinstance(scope, str) and scope in sys.modules:
            python_module = scope
        add_function(self, python_code, python_module, *args, **kwargs)

    def create_load_python_module(self: Any, mod: Any) -> Any:
        instruction = load_module(self, mod)
        pkg = getattr(self.tx, "package", None)
        if (pkg is not None and pkg.current_entry is not None and str(instruction.argval).startswith("___module_")
                and isinstance(mod, types.ModuleType) and sys.modules.get(mod.__name__) is mod):
            pkg.add_import_source(instruction.argval, mod.__name__)
        return instruction

    package.CompilePackage._add_function = _add_function
    codegen.PyCodegen.create_load_python_module = create_load_python_module
    return True


def _repair_local_class_guards() -> None:
    """Saves a frame that guards the type of an object whose class is defined inside a function
    (torch 2.15; also Inductor's, once backend="tpu" is loaded). Transformers 5.25 and later give
    every attention layer one (kernels' `Func`, the hub-kernel wrapper of `apply_rotary_pos_emb`).
    Dynamo refuses to save such a type guard (a package bypass: the frame is traced again in
    every new process), and would save the module as a plain `nn.Module` that fails the rebuilt
    guards. `Func` pickles itself through its own `__reduce__`: an object that a pickle round trip
    gives back as an instance of the same class is now saved that way, and its type guard kept."""
    type_match = getattr(guards.GuardBuilder, "TYPE_MATCH", None)
    reducer_override = getattr(getattr(guards, "GuardsStatePickler", None), "reducer_override", None)
    if type_match is None or reducer_override is None:
        return

    @functools.wraps(type_match)  # keeps its name and the check spec Dynamo attached to it
    def TYPE_MATCH(self: Any, guard: Any) -> None:  # noqa: N802 (Dynamo's name)
        type_match(self, guard)
        # Only where the guards are being saved: the round trip is no work for other compiles.
        if (getattr(self, "save_guards", True) and getattr(guard, "_unserializable", None) is not None
                and _pickles_itself(self.get(guard))):
            guard._unserializable = None

    def by_own_reduce(self: Any, obj: Any) -> Any:
        if (isinstance(obj, torch.nn.Module) and id(obj) in getattr(self, "guard_tree_values", ())
                and id(obj) not in getattr(self, "empty_values", ())
                and id(obj) not in getattr(self, "missing_values", ())
                and _pickles_itself(obj)):
            return NotImplemented
        return reducer_override(self, obj)

    guards.GuardBuilder.TYPE_MATCH = TYPE_MATCH
    guards.GuardsStatePickler.reducer_override = by_own_reduce


def _pickles_itself(value: Any) -> bool:
    """Whether `value`, of a class defined inside a function, has its own reduce that a new process
    can follow back to that class: a pickle round trip returns an instance of the same class."""
    cls = type(value)
    own_reduce = cls.__reduce__ is not object.__reduce__ or cls.__reduce_ex__ is not object.__reduce_ex__
    if cls.__qualname__ == cls.__name__ or not own_reduce:
        return False
    try:
        return type(pickle.loads(pickle.dumps(value))) is cls
    except Exception:  # noqa: BLE001 (any failure means it cannot)
        return False


def _build_loaded_guards_once() -> None:
    """Builds a loaded frame's guards once (torch 2.15). Under caching precompile Dynamo builds a
    frame's guards twice, the first time only to drop the kinds it cannot save (identity, closure
    and dict-version guards); a saved frame's guards had those dropped before they were saved, so
    at load the first build is waste: 0.3 of the 0.7 s of loading a UNet's frame."""
    load = getattr(package, "load_guard_manager", None)
    if load is None:
        return

    @functools.wraps(load)
    def load_guard_manager(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(caching_precompile=False):
            return load(*args, **kwargs)

    package.load_guard_manager = load_guard_manager


_REPAIRED = _repair_dynamo_packages()
_repair_local_class_guards()
_build_loaded_guards_once()


@dataclasses.dataclass
class TpuArtifact(BackendCacheArtifact[Any]):
    """A converted graph or a symbolic graph's `Traced`; deserialized, it is the callable
    Dynamo's bytecode calls."""

    def after_deserialization(self) -> Any:
        return found(pickle.loads(self.content))
