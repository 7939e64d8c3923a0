"""Benchmarks and the frozen encoder: corpora, embeddings, candidate streams.

Modules, lowest first (each imports only those above it):

* `corpus`: the data model (`Bank`, `Query`, `Corpus`, `EmbeddedCorpus`, stores, `gold_mask`).
* `parsing`: checked JSON reading; errors name the file, the record and the field.
* `sources`: official download sources of the benchmark files, the "file missing" message.
* `locomo`, `longmemeval`, `jsonl`: one loader per format.
* `corpora`: the loader registry, `load_corpus`, the data directory, `split_indices`.
* `download`: fetching the official files.
* `synthetic`: a seeded synthetic `EmbeddedCorpus`.
* `embedding_cache`, `encoder_base`: the on-disk cache and the `Encoder` interface.
* `flax_encoder`, `precomputed`: the two encoder kinds.
* `encoders`: `load_encoder`, `encode` (deduplicated, cached).
* `candidates`: top-K candidate sets, `Benchmark`, `load_benchmark` (load -> encode -> top-K).
"""
