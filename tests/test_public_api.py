"""The names users and scripts rely on stay where the docs put them, and the package's layers import
one way only (README "Layout", docs/design.md §2)."""
import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "asyncpp_ext"

# module -> names documented in the README, docs/ and the examples
PROMISED = {
    "asyncpp_ext": ["__version__", "build_info"],
    "asyncpp_ext.pipeline": ["Pipeline"],
    "asyncpp_ext.optim": ["AdamW", "Muon", "MuonHybrid", "ErrorFeedback", "NonFiniteGradientError",
                          "build_optimizer", "orthogonalize", "split_named_parameters"],
    "asyncpp_ext.models": ["GPT", "GPTConfig", "PRESETS", "preset_config", "Llama", "LlamaConfig",
                           "LLAMA_PRESETS", "llama_preset_config"],
    "asyncpp_ext.models.hf": ["from_config", "from_pretrained", "HFCausalLM", "HFModelError"],
    "asyncpp_ext.models.registry": ["ModelConfig", "MODEL_PRESETS", "model_config", "build_model"],
    "asyncpp_ext.data": ["load_tokens", "builtin_corpus", "BatchStream", "DataError"],
    "asyncpp_ext.data.prepare": ["main"],
    "asyncpp_ext.optim.lr_schedule": ["LRSchedule", "LR_SCHEDULES", "apply_lr"],
    "asyncpp_ext.optim.registry": ["OPTIMIZERS", "OptimizerSpec", "optimizer_spec", "muon_family"],
    "asyncpp_ext.training": ["DelaySimulator"],
    "asyncpp_ext.training.cli": ["main"],
    "asyncpp_ext.schedule.cli": ["main"],
    "asyncpp_ext.train": ["main"],
    "asyncpp_ext.commands": ["train", "prepare_data", "schedule", "export", "sample", "evaluate", "compare"],
    "asyncpp_ext.export": ["main"],
    "asyncpp_ext.training.export": ["main"],
    "asyncpp_ext.sample": ["main"],
    "asyncpp_ext.training.sample": ["main"],
    "asyncpp_ext.eval": ["main"],
    "asyncpp_ext.training.evaluation": ["main"],
    "asyncpp_ext.compare": ["main"],
    "asyncpp_ext.training.compare": ["main"],
    "asyncpp_ext.models.generate": ["generate", "choose_next", "filter_logits", "last_logits"],
    "asyncpp_ext.gpu_check": ["main"],
}

# subpackage -> the other parts of asyncpp_ext it may import. Lower layers never import upward:
# training drives pipelines; pipelines run optimizers, the models' compile and head-loss helpers and
# the schedule table; optim, models, data and schedule stand alone.
ALLOWED_IMPORTS = {
    "data": {"stop_signals", "directories", "command_line"},  # these three: stdlib only
    "models": set(),
    "optim": {"_ext", "precision"},  # precision.py: the "auto" dtype rule, torch only
    "schedule": {"_ext", "stop_signals", "figures", "command_line"},  # figures.py: matplotlib + directories.py
    "pipeline": {"_ext", "optim", "models", "schedule", "precision", "stop_signals"},
    "training": {"_ext", "info", "optim", "models", "data", "pipeline", "schedule", "precision", "stop_signals", "directories",
                 "oom", "command_line", "figures"},  # oom.py, command_line.py: stdlib only; figures.py: matplotlib
    "gpu_check": {"info", "optim"},  # runs everything else in subprocesses
}


@pytest.mark.parametrize("module", sorted(PROMISED))
def test_promised_names_import(module):
    mod = importlib.import_module(module)
    missing = [name for name in PROMISED[module] if not hasattr(mod, name)]
    assert not missing, f"{module} lost {missing}"
    for name in getattr(mod, "__all__", []):
        assert hasattr(mod, name), f"{module}.__all__ names {name}, which it does not define"


def test_console_scripts_resolve_to_callables():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) >= {"asyncpp-train", "asyncpp-schedule", "asyncpp-prepare-data", "asyncpp-export",
                            "asyncpp-sample", "asyncpp-eval", "asyncpp-compare"}
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), f"{name} -> {target}"


@pytest.mark.parametrize("module", ["asyncpp_ext.train", "asyncpp_ext.schedule", "asyncpp_ext", "asyncpp_ext.gpu_check",
                                    "asyncpp_ext.data.prepare", "asyncpp_ext.export",
                                    "asyncpp_ext.sample", "asyncpp_ext.eval", "asyncpp_ext.compare"])
def test_python_dash_m_entry_points_answer_help(module):
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage:"), r.stderr


def _imported_parts(path: Path) -> set[str]:
    """The first-level parts of asyncpp_ext a module under a subpackage imports."""
    parts = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level >= 2 and node.module:  # from ..x import y
                parts.add(node.module.split(".")[0])
            elif node.level >= 2:  # from .. import x
                parts.update(alias.name for alias in node.names)
            elif node.level == 0 and (node.module or "").startswith("asyncpp_ext."):
                parts.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            parts.update(a.name.split(".")[1] for a in node.names if a.name.startswith("asyncpp_ext."))
    return parts


def test_layers_import_one_way():
    subpackages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert sorted(ALLOWED_IMPORTS) == subpackages, "a new subpackage needs its place in ALLOWED_IMPORTS"
    wrong = []
    for sub in subpackages:
        for path in sorted((PACKAGE / sub).glob("*.py")):
            extra = _imported_parts(path) - ALLOWED_IMPORTS[sub]
            if extra:
                wrong.append(f"{path.relative_to(ROOT)} imports {sorted(extra)}")
    assert not wrong, "\n".join(wrong)


def _cli_imports(path: Path) -> set[str]:
    """Names a file imports from asyncpp_ext.training.cli ("*" for the module itself)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.endswith("training.cli") or (module.endswith("training") and
                                                   any(a.name == "cli" for a in node.names)):
                names.update("*" if a.name == "cli" else a.name for a in node.names)
            elif node.level == 1 and module == "cli" and path.parent.name == "training":
                names.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update("*" for a in node.names if a.name.endswith("training.cli"))
    return names


def test_only_entry_points_and_cli_tests_import_the_command_line():
    """The run is built by training/build.py and run.py; the CLI module only parses and
    dispatches, so nothing but the entry point, and tests of the command itself (its ``main``),
    imports it."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name not in ("train.py", "commands.py") and _cli_imports(path) and path != PACKAGE / "training" / "cli.py":
            wrong.append(str(path.relative_to(ROOT)))
    for path in sorted((ROOT / "bench").rglob("*.py")):
        if _cli_imports(path):
            wrong.append(str(path.relative_to(ROOT)))
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if _cli_imports(path) - {"main"}:
            wrong.append(f"{path.relative_to(ROOT)} imports {sorted(_cli_imports(path) - {'main'})}")
    assert not wrong, "\n".join(wrong)
    assert len((PACKAGE / "training" / "cli.py").read_text().splitlines()) <= 250
