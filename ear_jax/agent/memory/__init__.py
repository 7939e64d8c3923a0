"""The live agent's memory: `Memory` (the front, `front.py`) over its parts.

Layers inside, each importing only those before it: `checks`, `table` (SQLite rows), `bank`
(device bank and search), `scopes`, `lexical_bank`, `persistence`, `rows`, `encoder_slot`,
`config`, `episode`, `sessions`, `registry`, `driver` (the learner state), `learning`,
`recall` (`Session`), `batcher`, then `front` (`Memory`).
"""
from ear_jax.agent.memory.front import (AnswerFeedback, Memory, MemoryConfig, Recall, Session,
                                        SessionDroppedError, Slate, llm_feedback,
                                        run_critic_episode)

__all__ = ["AnswerFeedback", "Memory", "MemoryConfig", "Recall", "Session", "SessionDroppedError",
           "Slate", "llm_feedback", "run_critic_episode"]
