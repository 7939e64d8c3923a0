"""The pure JAX core: the paper's equations, learner state, episodes, inference and metrics."""
