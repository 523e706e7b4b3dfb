"""The modules of scripts/ for the tests of their pure parts: scripts/ is not a package, and its
tools import their siblings by name (scripts/ is first on the path when they run), so each is
loaded from its file under that same name, once."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.daemons import REPO


def load_script(name: str) -> ModuleType:
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
