"""Persistence shared by the agent and experiment layers: atomic, verified Orbax checkpoints."""
