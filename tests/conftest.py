import os
import re
from pathlib import Path

import pytest

# Without a GPU, Triton kernels run under the interpreter; it must be set before triton is imported.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["GEM_TUNE_CACHE"] = "0"  # tests tune afresh and never write the user's tuning cache


@pytest.fixture
def process_group():
    """A one-rank gloo process group (what gem.parallel creates in-process), destroyed afterwards even when the
    test fails, so no test inherits another's group. Yields the rank's device."""
    import torch.distributed as dist

    from gem.parallel.dims import init_distributed

    if dist.is_initialized():  # left by a test that did not clean up: start from a fresh group
        dist.destroy_process_group()
    device = init_distributed()
    try:
        yield device
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Hypothesis: a fixed seed profile in CI (GEM_CI=1), so a failure there reproduces; random exploration elsewhere.
try:
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
    if os.environ.get("GEM_CI") == "1":
        _hypothesis_settings.load_profile("ci")
except ImportError:  # hypothesis is a test dependency; without it the property tests fail at import
    pass


SKIP_ALLOWLIST = Path(__file__).with_name("skip_allowlist.txt")


def allowed_skip_patterns() -> list[re.Pattern]:
    lines = SKIP_ALLOWLIST.read_text().splitlines()
    return [re.compile(re.escape(line.strip())) for line in lines if line.strip() and not line.startswith("#")]


def unlisted_skips(reports) -> list[str]:
    """'<test>: <reason>' of each skip whose reason does not start with an allowed one."""
    patterns = allowed_skip_patterns()
    out = []
    for rep in reports:
        reason = str(rep.longrepr[2]) if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if not any(p.match(reason) for p in patterns):
            out.append(f"{rep.nodeid}: {reason}")
    return out


def pytest_sessionfinish(session, exitstatus):
    """In CI (GEM_CI=1) a skip whose reason is not in tests/skip_allowlist.txt fails the run."""
    if os.environ.get("GEM_CI") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    bad = unlisted_skips(skipped)
    if bad:
        reporter.write_line("skips not in tests/skip_allowlist.txt (GEM_CI=1 fails on them):", red=True)
        for line in bad:
            reporter.write_line(f"  {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
