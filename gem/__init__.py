"""gem: GEM-style recommender training (TorchRec embeddings, Triton jagged attention, 5D parallelism)."""

__version__ = "0.1.0"
