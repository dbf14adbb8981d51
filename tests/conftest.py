"""Test set-up: Triton runs in the interpreter without a GPU; hypothesis kept small and fast."""

import os

# The Triton interpreter computes tl.dot with numpy's matmul (OpenBLAS). OpenBLAS's AVX2/FMA
# kernels (Haswell, Zen) give an element of a tile other bits depending on its row within the
# tile, which would make the interpreter, not bik's kernel, depend on the batch; its AVX
# (Sandybridge) kernels and the AVX-512 ones do not. Read when numpy loads OpenBLAS: set first.
os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

# Under pytest-xdist (make test runs 2 workers) the cores are shared out between the workers:
# torch's OpenMP threads would otherwise outnumber the cores and spin against each other.
# Set before torch loads; the subprocesses a test starts inherit it.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first Triton kernel import

import pytest
from hypothesis import HealthCheck, Phase, settings
from transformers.utils import logging as transformers_logging

import bik
from bik import backends

# transformers makes its stderr handler at its first warning, bound to the sys.stderr of that
# moment: inside a test using capsys, a stream closed when the test ends, so a later test's
# warning would print a logging error. Made now, it writes to the session's stderr.
transformers_logging.get_logger()

settings.register_profile(
    "bik",
    max_examples=int(os.environ.get("BIK_EXAMPLES", "25")),
    deadline=None,
    derandomize=True,  # CI reruns see the same cases
    # Shrinking re-runs interpreted kernels for minutes; opt in with BIK_SHRINK=1.
    phases=[p for p in Phase if p is not Phase.shrink or os.environ.get("BIK_SHRINK") == "1"],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile("bik")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# An interpreted Triton kernel takes 10-100x a compiled CPU kernel's time a case, so the
# hypothesis tests of the triton backend run at most this many cases when interpreted (the
# first ones of the same derandomized sequence). make test-gpu-image runs them again under the
# GPU image's Triton; on a GPU they run compiled, with every case.
INTERPRETED_EXAMPLES = int(os.environ.get("BIK_INTERPRETED_EXAMPLES", "6"))


@pytest.fixture(autouse=True)
def fewer_interpreted_cases(request):
    """Caps the cases of a hypothesis test of the triton backend (a test of a test_triton_*
    file, or one parametrized with it) at INTERPRETED_EXAMPLES under the interpreter."""
    test = request.function
    current = getattr(test, "_hypothesis_internal_use_settings", None)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" and "triton" in request.node.nodeid
    if current is None or not interpreted or current.max_examples <= INTERPRETED_EXAMPLES:
        yield
        return
    # hypothesis reads the settings off the test when it runs: this item's alone
    test._hypothesis_internal_use_settings = settings(current, max_examples=INTERPRETED_EXAMPLES)
    try:
        yield
    finally:
        test._hypothesis_internal_use_settings = current


def invariant_backends(device=DEVICE):
    """Every registered batch-invariant backend that can run on ``device``."""
    usable = []
    for name in bik.available_backends():
        if name in ("auto", "reference"):
            continue
        try:
            backends.load(name).check_device(device)
        except (ImportError, RuntimeError):
            continue
        usable.append(name)
    return usable


if os.environ.get("BIK_REQUIRE_CPU") == "1" and "cpu" not in invariant_backends(
    torch.device("cpu")
):
    # make test sets this: the cpu cases must run, never be skipped for a missing build
    raise RuntimeError("BIK_REQUIRE_CPU=1 but the cpu backend cannot load: run make build")


# The files that take minutes (vLLM engines, the real model, interpreted kernels, process
# groups), slowest first as measured on the 2-core CI machine: pytest-xdist hands files to its
# workers in collection order (make test passes --no-loadscope-reorder), so the run does not
# end on one worker with a long file while the others wait. The rest follow in their order.
SLOWEST_FIRST = (
    "tests/integrations/test_vllm_families.py",
    "tests/integrations/test_hf_compile.py",
    "tests/integrations/test_vllm_speculative.py",
    "tests/integrations/test_vllm.py",
    "tests/rl/test_rl_vllm.py",
    "tests/rl/test_rl_vllm_tp.py",
    "tests/integrations/test_vllm_moe_parallel.py",
    "tests/integrations/test_vllm_tp.py",
    "tests/tools/test_docs.py",
    "tests/tools/test_bench_vllm.py",
    "tests/backends/test_cutlass_sm90.py",
    "tests/backends/test_triton_attention.py",
    "tests/rl/test_rl_harness.py",
    "tests/ops/test_attention.py",
    "tests/tools/test_verify_vllm.py",
    "tests/integrations/test_hf_static_decode.py",
    "tests/integrations/test_trl.py",
    "tests/tools/test_models.py",
    "tests/integrations/test_tensor_parallel.py",
    "tests/layers/test_paged_attention.py",
    "tests/rl/test_rl_distributed.py",
    "tests/rl/test_rl_edge.py",
    "tests/tools/test_bench.py",
    "tests/backends/test_triton_rows.py",
    "tests/integrations/test_expert_parallel.py",
)


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable


@pytest.fixture(params=invariant_backends())
def backend(request):
    """Runs the test once per invariant backend, with that backend selected."""
    with bik.use_backend(request.param):
        yield request.param


@pytest.fixture
def sinks_backend(backend):
    """``backend``, skipped where it has no attention sinks (``python -m bik backends``)."""
    if not backends.load(backend).attention_sinks:
        pytest.skip(f"the {backend} backend has no attention sinks")
    return backend


@pytest.fixture
def reference_backend():
    with bik.use_backend("reference"):
        yield "reference"


@pytest.fixture(autouse=True, scope="module")
def restore_process_state():
    """bik.vllm.enable (bik.vllm.LLM, an rl_harness vLLM rollout) selects bik's backend for the
    whole process and sets the variables its engine processes read: each test module leaves
    the backend and the environment as it found them, whatever module ran before it."""
    backend, environment = bik.get_backend(), dict(os.environ)
    yield
    bik.set_backend(backend)
    os.environ.clear()
    os.environ.update(environment)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """rl_harness tests: one warm-up cache per module (warm-ups are keyed by their config,
    so a module's runs share them). Shadows pytest's cache fixture, which no test uses."""
    return tmp_path_factory.mktemp("warmup-cache")


@pytest.fixture(scope="session")
def smollm2():
    """The real model's local directory (bik.testing.models; prepared on first use, then cached).
    Skips only where BIK_OFFLINE=1 forbids preparing it (a GPU image without network)."""
    from bik.testing import models

    try:
        return str(models.path("smollm2"))
    except models.ModelOfflineError as error:
        pytest.skip(str(error))
