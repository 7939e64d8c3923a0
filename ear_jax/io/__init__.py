"""Persistence shared by the agent and experiment layers: atomic, verified Orbax checkpoints
(`checkpoints`) and the checkpoints and final adapters of a whole run (`run_checkpoints`)."""
