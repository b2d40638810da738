"""GPU kernel tests: each kernel against the reference path of dsuf.model on fresh random inputs
at real V4-Flash shapes. They run only where CUDA is present (and print their error norms with
`-s`); on a machine without a GPU every test that needs one is skipped."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def cuda() -> torch.device:
    """The CUDA device, fresh random seeds per test; skips the test where there is no GPU."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    print(f"\n  seed {torch.seed()}")  # fresh inputs every run; the seed reproduces a failure
    return torch.device("cuda")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report names the torch seed in force (a module's fixture seeds once for all
    its tests, and its printed seed is shown only with the first test's output)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        report.sections.append(("torch seed", f"torch.initial_seed() = {torch.initial_seed()} (run the module from its start to replay it)"))
