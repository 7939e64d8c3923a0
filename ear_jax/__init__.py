"""ear_jax: Exploratory-Assimilating Reflection (EAR) for adaptive memory retrieval, in JAX.

Pure functions over immutable pytree state; a whole online episode is one `lax.scan`, vmapped over
seeds and hyperparameters. Callers `jax.jit` with the config static
(`jax.jit(run_episode, static_argnames="config")`). This module is the method's table of contents;
the rest is in its subpackages (`core`, `data`, `io`, `index`, `agent`, `experiment`; importing
this module imports no experiment code). README.md has the quick start, the design document the
map from each paper equation to its function.
"""
from ear_jax.core.config import EARConfig, HParams, Method, default_hparams, stack_hparams
from ear_jax.core.stream import Stream
from ear_jax.core.adapter import AdapterParams, relevance
from ear_jax.core.explorer import BanditStats, explore, ucb_scores, update_bandit
from ear_jax.core.buffer import ReplayBuffer, push_experiences, select_replay
from ear_jax.core.learner import LearnerState, init_learner, train_batch, train_batch_on_feedback
from ear_jax.core.episode import run_episode
from ear_jax.core.inference import EvalResult, evaluate
from ear_jax.core.critic import SlateView, make_simulated_critic
from ear_jax.core.types import Critic
from ear_jax.agent.memory import Memory, MemoryConfig
from ear_jax.io.run_checkpoints import CheckpointError, restore_adapter

__version__ = "0.1.0"

__all__ = [
    # a method: its static config, its hyperparameters (and its critic) as one object
    "Method", "EARConfig", "HParams", "default_hparams", "stack_hparams",
    # state and data
    "Stream", "AdapterParams", "BanditStats", "ReplayBuffer", "LearnerState",
    # one function per equation: Eq. (3)-(4), (5), (7)-(8), (9), (13)-(14), (15); one learner step
    "relevance", "ucb_scores", "explore", "update_bandit", "push_experiences", "select_replay",
    "init_learner", "train_batch", "train_batch_on_feedback",
    # whole episodes and evaluation
    "run_episode", "evaluate", "EvalResult",
    # the critic protocol
    "Critic", "SlateView", "make_simulated_critic",
    # the agent front (its one configuration) and trained adapters
    "Memory", "MemoryConfig", "CheckpointError", "restore_adapter",
]
