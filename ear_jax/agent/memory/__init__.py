"""The live agent's memory: `Memory` (the front, `front.py`) over its parts.

Layers inside (each imports only those before it): `checks` (the arguments' validators, store
names), `table` (the rows in SQLite), `bank` (the device bank, exact and ANN search), `scopes`
(scope names and each scope's rows), `lexical_bank` (the BM25 / hybrid first stage), `config`
(`MemoryConfig`), `encoder_slot`, `episode` (one round's slates, host critic loops), `sessions` (the
`Session` handle and the registry), `driver` (the learner state), `forget`, `recall`, `persistence`
(the learner item and the directory's files), `batcher` (the micro-batching of concurrent requests),
then `front` (`Memory`).
"""
from ear_jax.agent.memory.front import (AnswerFeedback, Memory, MemoryConfig, Recall, Session,
                                        SessionDroppedError, Slate, llm_feedback,
                                        run_critic_episode)

__all__ = ["AnswerFeedback", "Memory", "MemoryConfig", "Recall", "Session", "SessionDroppedError",
           "Slate", "llm_feedback", "run_critic_episode"]
