"""ear_jax: Exploratory-Assimilating Reflection (EAR) for adaptive memory retrieval, in JAX.

Pure functions over immutable pytree state; a whole online episode is one jitted `lax.scan`,
vmapped over seeds and hyperparameters. See README.md for the quick start and EAR_SPEC for the
equations each function implements.
"""
from ear_jax.core.adapter import (AdapterParams, adapt_memories, adapt_queries, adapter_scores,
                             init_adapter, relevance_log_probs, relevance_logits, safe_normalize)
from ear_jax.data.candidates import (Benchmark, build_benchmark, embed_corpus, load_benchmark,
                                retriever_report, top_k_candidates)
from ear_jax.data.corpora import (load_corpus, load_jsonl, load_locomo, load_longmemeval,
                              normalize_evidence, split_indices)
from ear_jax.data.encoders import encode, load_encoder
from ear_jax.experiment.sharding import initialize_distributed, run_mesh, sharded_episodes
from ear_jax.data.synthetic import make_synthetic
from ear_jax.experiment.checkpointing import CheckpointError, restore_adapter
from ear_jax.core.buffer import ReplayBuffer, init_buffer, push_experiences, select_replay
from ear_jax.core.config import (METHODS, EARConfig, HParams, default_hparams, stack_hparams)
from ear_jax.core.critic import (CRITICS, OracleCritic, SimulatedCritic, SlateView, default_critic,
                                 false_positive_rate, make_simulated_critic, oracle_critic,
                                 simulated_critic, slate_view, stack_critics)
from ear_jax.core.slates import gather_slate, top_s_slate
from ear_jax.core.retrieval import retrieve, slate_from_candidates, top_k_search
from ear_jax.core.explorer import (BanditStats, ExplorerOutput, explore, greedy_slate, init_bandit,
                              redundancy, ucb_scores, update_bandit)
from ear_jax.core.inference import (EvalResult, adapter_only_slate, evaluate, evaluate_jit,
                               explorer_slate)
from ear_jax.core.learner import (LearnerState, QueryRecord, apply_gradients, collect_feedback,
                                  feedback_loss, init_learner, make_optimizer, query_loss,
                                  train_batch, train_batch_jit, train_batch_on_feedback,
                                  train_batch_on_feedback_jit)
from ear_jax.core.episode import (episode_keys, run_episode, run_episode_jit, train_stream,
                                  train_stream_jit, validate_stream)
from ear_jax.agent.llm_critic import (CriticResult, LLMCritic, LLMCriticConfig, build_messages,
                                labels_from_citations, parse_citations)
from ear_jax.core.losses import (aggregate_feedback, combined_loss, gumbel_top_s, ranking_loss,
                            replay_loss, replay_rewards, slate_log_probs)
from ear_jax.agent.memory import Memory, Retrieval, llm_feedback, run_critic_episode
from ear_jax.core.metrics import masked_mean, slate_hit, slate_recall
from ear_jax.core.stream import Stream, concat_streams, make_stream

__version__ = "0.1.0"

__all__ = [
    "Benchmark", "build_benchmark", "embed_corpus", "load_benchmark", "retriever_report",
    "top_k_candidates", "load_corpus", "load_jsonl", "load_locomo", "load_longmemeval",
    "normalize_evidence", "split_indices", "encode", "load_encoder", "initialize_distributed",
    "run_mesh", "sharded_episodes", "make_synthetic",
    "CheckpointError", "Memory", "Retrieval", "llm_feedback", "restore_adapter",
    "run_critic_episode",
    "AdapterParams", "BanditStats", "CriticResult", "EARConfig", "EvalResult", "ExplorerOutput",
    "HParams", "LLMCritic", "LLMCriticConfig", "LearnerState", "METHODS", "QueryRecord",
    "ReplayBuffer", "Stream", "adapt_memories", "adapt_queries", "adapter_only_slate",
    "adapter_scores", "aggregate_feedback", "apply_gradients", "build_messages", "combined_loss",
    "concat_streams", "default_hparams", "episode_keys", "evaluate", "evaluate_jit", "explore",
    "explorer_slate", "false_positive_rate", "feedback_loss", "greedy_slate", "gumbel_top_s",
    "init_adapter", "init_bandit", "init_buffer", "init_learner", "labels_from_citations",
    "make_optimizer", "make_stream", "masked_mean", "oracle_critic", "parse_citations",
    "push_experiences", "query_loss", "ranking_loss", "redundancy", "relevance_log_probs",
    "relevance_logits", "replay_loss", "replay_rewards", "run_episode", "run_episode_jit",
    "safe_normalize", "select_replay", "simulated_critic", "slate_hit", "slate_log_probs",
    "slate_recall", "stack_hparams", "top_s_slate", "train_batch", "train_batch_jit",
    "train_batch_on_feedback", "train_batch_on_feedback_jit", "train_stream", "train_stream_jit",
    "ucb_scores", "update_bandit", "validate_stream", "CRITICS", "OracleCritic", "SimulatedCritic",
    "SlateView", "default_critic", "make_simulated_critic", "slate_view", "stack_critics",
    "gather_slate", "retrieve", "slate_from_candidates", "top_k_search", "collect_feedback",
]
