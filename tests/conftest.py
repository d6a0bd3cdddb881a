"""Shared test set-up.

Without a GPU, Triton kernels run on the CPU under its interpreter; the variable must be set
before triton is first imported, hence here, at collection time.

Packages of pyproject.toml's ``test`` extra that are missing (or outside its pins) are named in
pytest's header and summary: the tests that need them skip. Under CI (``MEMKERN_CI=1``, set by
``.ci/run``) the run fails at its start instead.
"""
import importlib.metadata
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import memkern  # noqa: E402  (after TRITON_INTERPRET)

# Property-based tests (hypothesis): CI runs a few examples per test ("ci"); a long local run
# is MEMKERN_FUZZ_PROFILE=long (or pytest's --hypothesis-profile=long). No example database:
# every run draws fresh examples, and a failure prints the call that reproduces it.
settings.register_profile(
    "ci", max_examples=150, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large])
settings.register_profile("long", settings.get_profile("ci"), max_examples=3000)
settings.load_profile(os.environ.get("MEMKERN_FUZZ_PROFILE", "ci"))


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def missing_test_dependencies() -> list[str]:
    """What of pyproject.toml's ``test`` extra is missing here or outside its pin, one entry
    per package saying how to install it."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            return ["the test extra was not checked (Python 3.10 without tomli)"]
    from packaging.requirements import Requirement  # pytest's own dependency

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        extra = tomllib.load(fh)["project"]["optional-dependencies"]["test"]
    problems = []
    for text in extra:
        requirement = Requirement(text)
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{requirement.name} is not installed (pip install '{text}')")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{requirement.name} {version} is installed, the test extra "
                            f"wants '{text}'")
    return problems


_TEST_EXTRA_PROBLEMS = missing_test_dependencies()


def pytest_sessionstart(session):
    if _TEST_EXTRA_PROBLEMS and os.environ.get("MEMKERN_CI") == "1":
        pytest.exit("MEMKERN_CI=1: the test extra is incomplete, so tests would skip: "
                    + "; ".join(_TEST_EXTRA_PROBLEMS) + " (bash scripts/install.sh --test)",
                    returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_report_header(config):
    """Which backends the cases were generated for: a backend that is absent here (e.g. the
    C++ one when the build was skipped) has no cases at all, so say so at the top; and what of
    the test extra is missing (the tests needing it skip)."""
    present = memkern.backends()
    missing = [] if memkern.compiled.has_cpu else [f"cpu ({memkern.compiled.missing_reason})"]
    return [f"memkern backends: {', '.join(b for b, ok in present.items() if ok)}"
            + (f"; no cases for: {', '.join(missing)}" if missing else ""),
            "test extra: " + ("incomplete: " + "; ".join(_TEST_EXTRA_PROBLEMS)
                              if _TEST_EXTRA_PROBLEMS else "complete")]


def pytest_terminal_summary(terminalreporter):
    if _TEST_EXTRA_PROBLEMS:
        terminalreporter.section("the test extra is incomplete: tests needing it skipped")
        for problem in _TEST_EXTRA_PROBLEMS:
            terminalreporter.line(problem)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Fresh random data every run, but the seed is printed so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed: {seed}")
    yield


# A test of what memkern's own layer algorithm saves, recomputes or routes: without the
# compiled extension (MEMKERN_DISABLE_EXT=1, a failed build) memkern.nn's layers are torch's own
# (memkern.nn.functional), so there is nothing of memkern's to test.
needs_layer_extension = pytest.mark.skipif(
    not memkern.compiled.has_cpu,
    reason="without the compiled extension memkern's layers are torch's own")


def cpu_backends() -> list[str]:
    """Backends that can run ops on CPU tensors in this process."""
    cpu = torch.device("cpu")
    return [b for b in memkern.backend.NAMES if memkern.backend.runs_on(b, cpu)]


def runs_cpp_autograd(node) -> bool:
    """Whether autograd node ``node`` (a ``grad_fn``) is one of memkern's C++ ones: a
    ``torch::autograd::Node`` named ``memkern::<Layer>Backward``."""
    return node.name().startswith("memkern::")
