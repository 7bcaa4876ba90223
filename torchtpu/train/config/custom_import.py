"""`[experimental] custom_import`: the user's own module, imported while the configuration is read and
before it is checked, so that the model families it registers (torchtpu.models.registry.register_family)
are there when `[model] name` and `flavor` are checked, in every process that reads the configuration.

    [experimental]
    custom_import = "my_kernels"        # or "path/to/my_kernels.py"

A dotted name is imported as `python -m` would find it: from the working directory, then PYTHONPATH
and the installed packages. A `.py` file is imported under its file name. Standard library only, like
the rest of the configuration.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from .job_config import ConfigError

__all__ = ["import_custom"]

_KEY = ("experimental", "custom_import")


def import_custom(table: dict, table_source: str | None, overrides=()) -> None:
    """Import the module that the last `[experimental] custom_import` names, among the TOML file's
    table and the command line's overrides ((path, value, option) in order); nothing when none does
    or it is "". A module that cannot be found is a one-line ConfigError naming where to put it; an
    error inside the module is the module's own, raised as is."""
    name, source = "", None
    section = table.get("experimental") if isinstance(table, dict) else None
    if isinstance(section, dict) and isinstance(section.get("custom_import"), str):
        name, source = section["custom_import"], table_source or "<dict>"
    for path, value, _option in overrides:
        if tuple(path) == _KEY and isinstance(value, str):
            name, source = value, "command line"
    name = name.strip()
    if not name:
        return
    where = f"{source}: [experimental] custom_import = {name!r}"
    if name.endswith(".py"):
        _import_file(name, where)
        return
    if not all(part.isidentifier() for part in name.split(".")):
        raise ConfigError(f"{where}: not a module name; allowed: a dotted module name (my_kernels) or a .py file")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # as `python -m` and torchrun scripts find the user's modules
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise ConfigError(
                f"{where}: no module {e.name!r} in the working directory ({cwd}) or on PYTHONPATH; "
                "run from the folder that holds it, add that folder to PYTHONPATH, or give the .py file's path"
            ) from None
        raise


def _import_file(path: str, where: str) -> None:
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise ConfigError(f"{where}: no such file ({full})")
    module_name = os.path.splitext(os.path.basename(full))[0]
    if not module_name.isidentifier():
        raise ConfigError(f"{where}: the file's name is not a module name; rename it (e.g. my_kernels.py)")
    known = sys.modules.get(module_name)
    if known is not None:
        if os.path.abspath(getattr(known, "__file__", "") or "") == full:
            return  # imported already (an earlier load of this configuration)
        raise ConfigError(
            f"{where}: a module named {module_name!r} is imported already from elsewhere; rename the file"
        )
    spec = importlib.util.spec_from_file_location(module_name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so that "module:attribute" strings in a registered family resolve
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
