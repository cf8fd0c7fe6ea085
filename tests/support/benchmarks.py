"""The benchmark scripts (benchmarks/*.py are scripts, not a package) as modules, for the tests of their parts."""

from __future__ import annotations

import importlib.util
import sys
from functools import lru_cache
from types import ModuleType

from tests.support.processes import ROOT


@lru_cache(maxsize=None)
def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py, imported once, with benchmarks/ on the path for the scripts it imports in turn."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    if name in sys.modules:  # imported already by another script of benchmarks/
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
