"""`python -m gem.bench.attention`: the attention benchmark (the same as scripts/bench_attention.py)."""

from gem.bench.attention import main

main()
