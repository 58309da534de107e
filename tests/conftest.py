import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # so `tests.golden` and `tools` import

# Fresh random inputs every run, and the seed that made them printed when a test fails, so the failure
# can be replayed: GLMVIT_TEST_SEED=<seed> python -m pytest ... (one seed for the whole run).
_RUN_SEED = int(os.environ.get("GLMVIT_TEST_SEED") or np.random.SeedSequence().entropy % (1 << 63))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CuPy and a CUDA GPU (skipped, saying why, where there is none)")


def pytest_report_header(config):
    return f"random seed: {_RUN_SEED} (replay with GLMVIT_TEST_SEED={_RUN_SEED})"


def test_seed(nodeid: str) -> int:
    """The seed of one test: the run's seed mixed with the test's id, so that each test draws its own
    inputs and replays them alone (pytest -k) with the same GLMVIT_TEST_SEED."""
    return int(np.random.SeedSequence([_RUN_SEED, *nodeid.encode()]).generate_state(1, np.uint64)[0])


test_seed.__test__ = False  # a helper, not a test


@pytest.fixture
def rng(request):
    """A NumPy Generator seeded for this test; its seed is reported if the test fails."""
    seed = test_seed(request.node.nodeid)
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def _module_rng(request, monkeypatch):
    """A test module's shared `rng` (module_rng's) reseeded for each test, as the rng fixture is."""
    if isinstance(getattr(request.module, "rng", None), np.random.Generator):
        monkeypatch.setattr(request.module, "rng", np.random.default_rng(test_seed(request.node.nodeid)))


def module_rng(name: str) -> np.random.Generator:
    """A module-level Generator for draws made at import (parametrize lists), seeded from the run's seed;
    each test then gets it reseeded for itself (_module_rng)."""
    return np.random.default_rng(test_seed(name))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("random seed", f"GLMVIT_TEST_SEED={_RUN_SEED} python -m pytest '{item.nodeid}'"))


def gpu_or_skip():
    """Import CuPy and check for a device, or skip the calling test module saying why. A GPU test module
    also sets `pytestmark = pytest.mark.gpu`, so that `-m gpu` / `-m "not gpu"` select by it."""
    try:
        import cupy
    except ImportError as e:
        pytest.skip(f"GPU test: CuPy is not installed ({e}); install the cuda12/cuda13 extra on a GPU machine",
                    allow_module_level=True)
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device
        pytest.skip(f"GPU test: no usable CUDA device ({type(e).__name__}: {e})", allow_module_level=True)
    if n == 0:
        pytest.skip("GPU test: no CUDA device", allow_module_level=True)
    return cupy


def said_within(call, error, seconds: float = 20.0) -> str:
    """call() in a daemon thread: the message of the `error` it raises, "returned" if it returns; fails (not
    hangs) if it is still running after `seconds` (a read of a FIFO or /dev/zero that was not refused)."""
    import threading

    said = []

    def run():
        try:
            call()
            said.append("returned")
        except error as e:
            said.append(str(e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds:g} s: it blocked"
    return said[0]


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray of 2 CPUs for one test module (the `ray` extra's tests)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()
