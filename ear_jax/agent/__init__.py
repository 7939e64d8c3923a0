"""The agent layer: the stateful `Memory` and LLM clients."""
