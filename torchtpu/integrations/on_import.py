"""Patching a library's module when it is imported: at once if it already is, else right after its
import runs (a `sys.meta_path` finder), so that installing a patch imports nothing."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType

Patches = dict[str, Callable[[ModuleType], None]]


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs `patches[name]` on module `name` right after it is imported."""

    def __init__(self, patches: Patches):
        self.patches = patches

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.patches:
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
        patch = self.patches[fullname]

        def exec_then_patch(module):
            exec_module(module)
            patch(module)

        loader.exec_module = exec_then_patch
        return spec


def patch_on_import(patches: Patches) -> None:
    """Apply each patch to its module: now where the module is loaded, else when it is imported.
    Each patch must tolerate running twice on a module (it marks what it replaced)."""
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _PatchOnImport) and f.patches is patches for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(patches))
