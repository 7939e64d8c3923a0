"""Benchmarks and the frozen encoder: corpora, embeddings, candidate streams."""
