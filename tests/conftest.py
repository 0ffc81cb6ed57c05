import os

# Kernels run under the Triton interpreter on CPU; must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
