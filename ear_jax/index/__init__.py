"""Approximate candidate search (faiss) behind `Memory(index=...)`: see `ear_jax.index.ann`."""
