"""Where jagged_attention's torch alternatives beat its Triton kernel, and the dispatch table kernel="auto" reads
(gem.bench.dispatch; --help). Needs gem importable (pip install -e ., or PYTHONPATH=<checkout>)."""

from gem.bench.dispatch import main

if __name__ == "__main__":
    main()
