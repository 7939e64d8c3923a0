"""Benchmarks and the frozen encoder: corpora, embeddings, candidate streams.

Modules, lowest first: `corpus` (data model), `parsing`, `sources`, the loaders (`locomo`,
`longmemeval`, `jsonl`), `corpora` (registry, split), `download`, `synthetic`, `embedding_cache`,
`encoder_base`, the encoders, `encoders` (`load_encoder`, `encode`), `candidates`
(`load_benchmark`).
"""
