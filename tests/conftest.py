import os

# Without a GPU, Triton kernels run under the interpreter; it must be set before triton is imported.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["GEM_TUNE_CACHE"] = "0"  # tests tune afresh and never write the user's tuning cache
