"""The live agent's memory: `Memory` (the front, `front.py`) over its parts.

Layers inside (each imports only those before it): `bank` (ids, texts, device embeddings, exact
search) and `lexical_bank` (BM25 / hybrid first stage), `encoder_slot`, `episode` (one round's
slates, host critic loops), `sessions` (one session per question), `driver` (the learner state),
`forget`, `recall`, `persistence` (checkpoints of a `persistence.Snapshot`), then `front`.
"""
from ear_jax.agent.memory.front import (AnswerFeedback, Memory, Retrieval, llm_feedback,
                                        run_critic_episode)

__all__ = ["AnswerFeedback", "Memory", "Retrieval", "llm_feedback", "run_critic_episode"]
