"""Attention benchmark: our Triton kernels beside the alternatives, on one GPU (gem.bench.attention; --help).
Needs gem importable (pip install -e ., or PYTHONPATH=<checkout>)."""

from gem.bench.attention import main

if __name__ == "__main__":
    main()
