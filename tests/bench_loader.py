"""Load a bench/ script as a module for tests (the scripts are not a package)."""
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench_script(name: str):
    """bench/<name>.py imported as module ``name`` (registered in sys.modules, where dataclasses
    look their module up by name)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
