"""The live agent's memory: `Memory` (the front, `front.py`) over its parts.

Layers inside (each imports only those before it): `checks` (the arguments' validators, store
names), `table` (the rows in SQLite), `bank` (the device bank, exact and ANN search), `scopes`
(scope names and each scope's rows), `lexical_bank` (the BM25 / hybrid first stage),
`persistence` (the directory's files), `rows` (`Rows`: the table and everything derived from it),
`config` (`MemoryConfig`), `encoder_slot`, `episode` (one round's jitted calls, host critic
loops), `sessions` (the four kinds of session), `registry` (the sessions by id), `driver` (the
learner state), `learning` (`Learning`: sessions and learner behind the lock), `recall` (the
`Session` handle and the recall loop), `batcher` (micro-batching), then `front` (`Memory`).
"""
from ear_jax.agent.memory.front import (AnswerFeedback, Memory, MemoryConfig, Recall, Session,
                                        SessionDroppedError, Slate, llm_feedback,
                                        run_critic_episode)

__all__ = ["AnswerFeedback", "Memory", "MemoryConfig", "Recall", "Session", "SessionDroppedError",
           "Slate", "llm_feedback", "run_critic_episode"]
