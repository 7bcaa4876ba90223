"""Patching a library's module when it is imported: at once if it already is, else right after its
import runs (a `sys.meta_path` finder), so that installing a patch imports nothing. A patch may also
wrap the import itself (`around`: a context manager entered while the module's body runs)."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import ModuleType

Patches = dict[str, Callable[[ModuleType], None]]
Arounds = dict[str, Callable[[], AbstractContextManager]]


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs module `name`'s body inside `around[name]()` and `patches[name]` on it right after."""

    def __init__(self, patches: Patches, around: Arounds):
        self.patches = patches
        self.around = around

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.patches and fullname not in self.around:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module
        patch = self.patches.get(fullname)
        around = self.around.get(fullname, contextlib.nullcontext)

        def exec_then_patch(module):
            with around():
                exec_module(module)
            if patch is not None:
                patch(module)

        loader.exec_module = exec_then_patch
        return spec


def patch_on_import(patches: Patches, around: Arounds | None = None) -> None:
    """Apply each patch to its module: now where the module is loaded, else when it is imported.
    Each patch must tolerate running twice on a module (it marks what it replaced). `around[name]`
    wraps the body of module `name` when it is imported later (a module loaded already keeps its
    body as it ran)."""
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _PatchOnImport) and f.patches is patches for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(patches, around or {}))
