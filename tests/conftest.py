import os

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
