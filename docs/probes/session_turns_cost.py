"""A probe, not part of the library (session 18): the host cost of `scopes.SessionTurns` for one
session of 200k rows (build, appends, deletes). Usage: python docs/probes/session_turns_cost.py"""
import time, numpy as np
from ear_jax.agent.memory.scopes import SessionTurns
n = 200000
t = SessionTurns(); t0 = time.perf_counter(); t.add(np.arange(n), np.zeros(n, np.int64)); print("bulk", time.perf_counter() - t0)
t0 = time.perf_counter()
for i in range(n, n + 2000): t.add([i], [0])
print("2000 appends", time.perf_counter() - t0)
t0 = time.perf_counter(); m = t.remove([n + 1999]); print("remove last", time.perf_counter() - t0, len(m))
t0 = time.perf_counter(); m = t.remove([5]); print("remove early", time.perf_counter() - t0, len(m))
