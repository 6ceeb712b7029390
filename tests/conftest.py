"""Shared pytest wiring: GPU auto-skip for `cuda` tests, helpers for multi-process tests, and
`--hide-module NAME` to run the suite as if an optional package were not installed."""
import os
import shutil
import socket
import sys
import tempfile

import pytest

INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"


def pytest_addoption(parser):
    parser.addoption("--hide-module", action="append", default=[], metavar="NAME",
                     help="make `import NAME` (and its submodules) fail as if NAME were not installed, "
                          "to check that the tests needing an optional extra skip without it")


def pytest_configure(config):
    for name in config.getoption("hide_module"):
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[loaded]
        sys.modules[name] = None  # import raises ModuleNotFoundError; importlib.util.find_spec gives None
    _share_one_inductor_cache(config)


def _share_one_inductor_cache(config):
    """One inductor cache for the whole run -- every test, xdist worker, pipeline rank and bench
    subprocess (they inherit the variable) -- unless the caller chose one: a graph compiled by one
    test is a cache hit for the next that compiles it (the compile tests, the CLI runs with
    --compile and the bench smokes compile the same few blocks; a cold run pays inductor's C++
    builds once per graph instead of once per process). pytest's cache folder keeps it between runs
    (.pytest_cache/d/inductor); under -p no:cacheprovider a temporary folder, removed at the end.
    Set by the controller before xdist starts its workers, which see it set and keep it."""
    if os.environ.get(INDUCTOR_CACHE):
        return
    cache = getattr(config, "cache", None)
    try:
        if cache is not None:
            os.environ[INDUCTOR_CACHE] = str(cache.mkdir("inductor"))
            return
    except OSError:  # a read-only checkout: a temporary folder instead
        pass
    os.environ[INDUCTOR_CACHE] = config._asyncpp_inductor_tmp = tempfile.mkdtemp(prefix="asyncpp-inductor-")


def pytest_unconfigure(config):
    made = getattr(config, "_asyncpp_inductor_tmp", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)
        os.environ.pop(INDUCTOR_CACHE, None)


def _gpu_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# Under pytest-xdist (`make test`: -n auto --dist loadgroup) the tests of these files (or single
# tests, "file::name") run on one worker, one after another: they share what one process keeps warm
# (test_compile*.py: dynamo's and inductor's in-process caches and the inductor cache directory they
# point TORCHINDUCTOR_CACHE_DIR at; test_bad_inputs.py: its module fixture's two training runs;
# test_examples.py: its module fixture's run of the example script),
# and side by side they would only compete for the cores.
XDIST_GROUPS = {"test_compile.py": "inductor", "test_compile_regions.py": "inductor", "test_compile_cuda.py": "inductor",
                "test_stage_compute.py::test_compiled_real_pipeline_equals_the_compiled_simulation": "inductor",
                "test_stage_compute.py::test_stage_scope_real_pipeline_equals_its_simulation": "inductor",
                "test_z_loss.py::test_the_compiled_gradient_pass_forms_the_term_as_the_eager_one": "inductor",
                "test_bad_inputs.py": "bad_inputs", "test_examples.py": "examples"}


def xdist_group(nodeid: str):
    """The XDIST_GROUPS group of a test's node id, or None."""
    path, _, name = nodeid.partition("::")
    file = path.rsplit("/", 1)[-1]
    return XDIST_GROUPS.get(f"{file}::{name.split('[')[0]}") or XDIST_GROUPS.get(file)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which the suite runs without too
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup by XDIST_GROUPS, read from the node ids the controller schedules. (xdist's
    own xdist_group marks append the group to a test's node id on the worker, which pytest 9.2's
    computed node ids no longer take: those marks group nothing there.)"""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class Groups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid) or super()._split_scope(nodeid)
    return Groups(config, log)


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (none visible)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_intra_op_thread():
    """Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine spinning
    OpenMP threads made such runs 20-70x slower; the numbers do not depend on it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for gloo rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def groups_restored():
    """Fresh process-wide compiled groups (models/compile.py) for the test, and the earlier ones
    back after it: a test that replaces inductor's compile_fx must use it, since a group compiled
    meanwhile keeps the stand-in's code in its dynamo cache (``_compile_groups_use_inductor``)."""
    from asyncpp_ext.models.compile import _GROUPS

    saved = dict(_GROUPS)
    _GROUPS.clear()
    yield
    _GROUPS.clear()
    _GROUPS.update(saved)


def stale_compile_groups() -> dict:
    """The process-wide compiled groups (models/compile.py, by key) made for inductor whose graphs
    go to something other than inductor's compile_fx as it is now: groups made while a test had
    replaced it, which would run the stand-in's code in every later test of the process."""
    compile_mod, fx_mod = sys.modules.get("asyncpp_ext.models.compile"), sys.modules.get("torch._inductor.compile_fx")
    if compile_mod is None or fx_mod is None:
        return {}  # nothing compiled with inductor in this process yet
    return {key: g for key, g in compile_mod._GROUPS.items()
            if g.settings.backend == "inductor" and g.compiler.func is not fx_mod.compile_fx}


@pytest.fixture(autouse=True)
def _compile_groups_use_inductor(request):
    """After every test: no compiled group left on a stand-in for inductor's compile_fx (a test
    that replaces it takes ``groups_restored``). The stale groups are dropped before the failure,
    so that the tests after it are judged on their own."""
    yield
    stale = stale_compile_groups()
    if stale:
        from asyncpp_ext.models.compile import _GROUPS

        for key in stale:
            del _GROUPS[key]
        pytest.fail(f"{request.node.nodeid} left compiled groups {sorted(g.name for g in stale.values())} on a "
                    "stand-in for inductor's compile_fx; give the test the groups_restored fixture", pytrace=False)
