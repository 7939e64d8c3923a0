"""An EAR `Memory` served over the Model Context Protocol: the agent's own LLM is the critic.

Symbols: `k` memories per slate, `K` candidates, `T` Explorer rounds per question.

Six tools, each one call of the `Memory` API: `remember` -> `Memory.add`; `recall` ->
`Session.round` of the question's session (asked again after `cite`, the next round, so a
question's `T` rounds are one training query; `learn=false`: pages, `answer_ids`); `cite` ->
`Session.feedback`; `search` -> `Memory.search`; `forget` -> `Memory.delete`; `stats`.

`MemoryService` is the transport-free core: a bounded map (question, scope, learn) -> session and
retrieval ids `<run token>-<session>-<round>` (an id from before a restart is refused by name).
Every remember / forget is durable when it returns; the learner item is saved every
`save_learner_s` seconds when changed and at `close`. One question's rounds are ordered by its own
lock; no service lock is held across a `Memory` call. Transports: `mcp_stdio`, `mcp_http`.
"""
import collections
import contextlib
import re
import secrets
import sys
import threading
import time
from typing import Optional

from ear_jax.agent import mcp_http

MAX_TEXT_CHARS = 20_000  # one memory, question or answer
MAX_TEXTS = 512  # memories per `remember`
MAX_IDS = 1_000  # ids per `cite` / `forget`
MAX_SCOPE_CHARS = 200  # one scope name or date
MAX_OPEN = 4096  # questions whose session a repeated `recall` resumes (least recent dropped)
SAVE_LEARNER_S = 30.0  # default seconds between learner saves
WORKER_THREADS = 64  # tools running at once (each waits in `Memory`, e.g. for its batch)
KEY_LOCKS = 1024  # striped locks keeping one (question, scope)'s rounds in order

INSTRUCTIONS = (
    "A long-term memory that learns which memories help you. Store facts with `remember`. Before "
    "answering a question that may depend on earlier conversations, call `recall` with the "
    "question; answer from the memories it returns, then ALWAYS call `cite(retrieval_id, "
    "answer=<your answer>)` with your answer as you gave it (and, if you know them, used_ids= the "
    "ids of the memories your answer used): the memory learns from your answer which memories "
    "helped. If the memories were not enough, call `recall` again with the SAME question (after "
    "`cite`) to see a different selection. To answer without teaching the memory (e.g. at an "
    "evaluation), pass learn=false to `recall` and answer from its `answer_ids`. `search` looks "
    "up memories without learning; `forget` deletes memories permanently.")


class MemoryService:
  """The tools over one `Memory` (thread-safe, transport-free).

  Args:
    memory, memory_dir: the `Memory` served and its directory (None: never saved).
    save_learner_s: save the learner item this often (seconds) when changed (0: only at `close`).
  """

  def __init__(self, memory, memory_dir=None, save_learner_s: float = 0.0):
    if not save_learner_s >= 0:
      raise ValueError(f"save_learner_s must be >= 0, got {save_learner_s!r}")
    self.memory, self.memory_dir = memory, memory_dir
    self._ear = memory.config.ear  # (K, T)
    self.run_token = secrets.token_hex(4)  # names this server run in its retrieval ids
    self._lock = threading.Lock()  # the question map and the flags below (no Memory call inside)
    self._key_locks = [threading.Lock() for _ in range(KEY_LOCKS)]  # a question's rounds in order
    self._questions = collections.OrderedDict()  # (question, scope or None, learn) -> Session.id
    self._changed = False  # a tool changed the learner since the last save
    self.saves = 0
    self.closed = False
    self._stop, self._saver_thread = threading.Event(), None
    if save_learner_s > 0 and memory_dir is not None:
      self._saver_thread = threading.Thread(target=self._saver, args=(float(save_learner_s),),
                                            daemon=True, name="ear-mcp-learner-save")
      self._saver_thread.start()

  def _saver(self, every_s: float) -> None:
    while not self._stop.wait(every_s):
      try:
        self.save()
      except Exception as e:  # pylint: disable=broad-except  (the next save retries; keep serving)
        print(f"ear-mcp: learner save failed: {type(e).__name__}: {e}", file=sys.stderr)

  def _touch(self) -> None:
    with self._lock:
      self._changed = True

  def _slate(self, slate) -> list[dict]:
    """A slate's memories: id, text and date ('' for a memory deleted meanwhile)."""
    try:
      dates = [r["date"] for r in self.memory.get(list(slate.ids))]
    except ValueError:  # one was deleted since (`forget` in another thread): each on its own
      dates = []
      for i in slate.ids:
        try:
          dates.append(self.memory.get([i])[0]["date"])
        except ValueError:
          dates.append("")
    return [{"id": i, "text": t, "date": d} for i, t, d in zip(slate.ids, slate.texts, dates)]

  def _resume(self, retrieval_id):
    """`(Session, round)` named by a retrieval id of this run (ValueError naming it otherwise)."""
    shown = str(retrieval_id)[:40]
    m = re.fullmatch(r"([0-9a-f]+)-([0-9]+)-([0-9]+)", str(retrieval_id))
    if m is None:
      raise ValueError(f"retrieval_id {shown!r} is not a retrieval id returned by recall")
    if m[1] != self.run_token:
      raise ValueError(f"retrieval_id {shown!r} is from an earlier run of this server (it "
                       "restarted since) or from another server: call recall again")
    try:
      return self.memory.session(resume=int(m[2])), int(m[3])
    except ValueError as e:  # (closed by its last round's or page's cite, dropped, released)
      raise type(e)(f"retrieval_id {shown!r} names a session that has ended ({e}): call recall "
                    "again") from None

  def remember(self, texts, scope=None, dates=None) -> dict:
    return {"ids": self.memory.add(texts, scope=scope, dates=dates)}

  def recall(self, question, k: int = 5, scope=None, learn: bool = True) -> dict:
    """The next round of the question's open session in `scope`, else round 1 of a new one."""
    if not isinstance(learn, bool):
      raise TypeError(f"learn must be true or false, got {type(learn).__name__}")
    key = (question, scope, learn)
    with self._key_locks[hash(key) % KEY_LOCKS]:  # one question's rounds in order
      with self._lock:
        sid = self._questions.get(key)
      slate = None
      if sid is not None:
        try:
          session = self.memory.session(resume=sid)
          slate = session.round(k)
        except ValueError:  # its T rounds are played, or it was closed, dropped or evicted
          if not learn:  # (a test-time session past its pages: released here)
            self._close_session(sid)
      if slate is None:
        try:
          session = self.memory.session(question, scope=scope, learn=learn)
        except ValueError as e:  # (a bad question, or nothing in the scope: named with k)
          raise type(e)(f"recall(k={k}): {e}") from None
        try:
          slate = session.round(k)
        except ValueError:  # (k outside [1, K])
          session.close()
          raise
      with self._lock:
        self._questions[key] = slate.session_id
        self._questions.move_to_end(key)
        evicted = [self._questions.popitem(last=False)[1]
                   for _ in range(len(self._questions) - MAX_OPEN)]
        self._changed = self._changed or learn  # (a test-time session changes no learner)
      out = {"retrieval_id": f"{self.run_token}-{slate.session_id}-{slate.round}",
             "round": slate.round, "rounds_per_question": self._ear.num_rounds,
             "memories": self._slate(slate), "count": len(slate),
             "next": "answer from these memories, then call cite(retrieval_id, answer=<your "
                     "answer>) (and used_ids=<the ids you used>, if you know them)"}
      if not learn:
        out["answer_ids"] = list(session.answer().ids)
        if not len(slate):  # past its candidates: no page to cite, the next call starts over
          self._close_session(slate.session_id)
          out.update(retrieval_id=None, next="no more memories for this question: answer from "
                                             "the memories of answer_ids")
    for sid in evicted:
      self._close_session(sid)
    return out

  def cite(self, retrieval_id, used_ids=None, answer=None) -> dict:
    """A round's feedback: `used_ids`, `answer`, or both (their union; `Session.feedback`)."""
    if used_ids is None and answer is None:
      raise ValueError("cite needs used_ids or answer (or both): the ids of the recalled "
                       "memories your answer used, or your answer itself")
    session, round_ = self._resume(retrieval_id)
    if round_ <= session.rounds:
      raise ValueError(f"retrieval_id {retrieval_id!r} was already cited (its round's feedback "
                       "is consumed): call recall again")
    if round_ > session.rounds + 1:
      raise ValueError(f"retrieval_id {retrieval_id!r} is not a retrieval id returned by recall")
    trained = session.feedback(used_ids or (), answer=answer)  # (the T-th closes the session)
    out = {"recorded": True, "round": round_,
           "rounds_left": max(self._ear.num_rounds - round_, 0), "learner_step": bool(trained)}
    if session.learn:
      self._touch()
    else:  # (test time: nothing to train; the T-th page releases the frozen session)
      try:
        out["answer_ids"] = list(session.answer().ids)
      finally:
        if round_ >= self._ear.num_rounds:
          session.close()
    return out

  def search(self, question, k: int = 5, scope=None) -> dict:
    slate = self.memory.search(question, k, scope=scope)
    return {"memories": self._slate(slate), "count": len(slate)}

  def forget(self, ids) -> dict:
    deleted = self.memory.delete(ids)
    self._touch()
    return {"deleted": deleted}

  def stats(self) -> dict:
    m, st = self.memory, self.memory.stats
    return {"memories": len(m), "candidates": m.config.first_stage_name,
            "num_candidates": self._ear.num_candidates,
            "rounds_per_question": self._ear.num_rounds,
            **{name: int(st.get(name, 0)) for name in (
                "rounds", "searches", "feedback", "answer_feedback", "learner_steps", "pending",
                "memories_added", "memories_deleted", "batch_windows", "batch_requests",
                "batch_encoder_calls", "batch_searches")},
            "serves": "adapter" if st["serves_adapter"] else "first stage",
            "guard_evidence": int(st["guard_evidence"]),
            "open_questions": len(self._questions), "learner_saves": self.saves}

  def _close_session(self, sid: int) -> None:
    """Closes session `sid` (a training one is queued, a test-time one released), if open."""
    with contextlib.suppress(ValueError):  # closed already, dropped or evicted
      self.memory.session(resume=sid).close()

  def save(self) -> None:
    """Writes the learner item (`Memory.save`) when a tool changed it since the last save."""
    with self._lock:
      if not self._changed or self.memory_dir is None:
        return
      self._changed = False
    try:
      self.memory.save(self.memory_dir)
    except BaseException:
      self._touch()
      raise
    with self._lock:
      self.saves += 1

  def close(self) -> None:
    """Shutdown: queues the open sessions, saves the learner item, closes the memory; idempotent."""
    started = time.time()
    with self._lock:
      if self.closed:
        return
      self.closed = True
      sids, self._questions = list(self._questions.values()), collections.OrderedDict()
    self._stop.set()
    if self._saver_thread is not None:
      self._saver_thread.join()  # (a timer save in progress ends before the memory closes)
    for sid in sids:
      self._close_session(sid)
    if sids:
      self._touch()
    try:
      self.save()
      saved = time.time()
      st = self.memory.stats
      print(f"ear-mcp-server: shutdown: learner saved ({st['learner_steps']} learner steps, "
            f"{st['ready']} sessions queued) {saved - started:.2f} s after it began, at "
            f"{saved:.3f}", file=sys.stderr, flush=True)
    finally:
      self.memory.close()


def build_server(service: MemoryService, host: str = "127.0.0.1", port: int = 8000,
                 worker_threads: int = WORKER_THREADS):
  """A `FastMCP` server with the six tools over `service`, at most `worker_threads` at once.

  Arguments are strict JSON types (`k="5"` is a tool error, never coerced), sizes are bounded in
  the schema (`MAX_*`), an unknown argument is a tool error naming it. HTTP on a loopback address
  checks the Host and Origin headers (DNS rebinding).
  """
  from typing import Annotated  # pylint: disable=g-import-not-at-top
  import anyio  # pylint: disable=g-import-not-at-top
  from mcp.server.fastmcp import FastMCP  # pylint: disable=g-import-not-at-top
  from mcp.server.fastmcp.exceptions import ToolError  # pylint: disable=g-import-not-at-top
  from mcp.server.fastmcp.tools import Tool  # pylint: disable=g-import-not-at-top
  from pydantic import Field, StrictBool, StrictInt, StrictStr  # pylint: disable=g-import-not-at-top

  if isinstance(worker_threads, bool) or not isinstance(worker_threads, int) or worker_threads < 1:
    raise ValueError(f"worker_threads must be an int >= 1, got {worker_threads!r}")
  limiter = anyio.CapacityLimiter(worker_threads)

  async def run(fn, *args):
    """Runs a tool in a worker thread of `limiter`; bad input -> ToolError."""
    try:
      return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)
    except (ValueError, TypeError, KeyError) as e:  # Memory's input errors (and the service's)
      raise ToolError(f"{type(e).__name__}: {e}") from None

  tools = []

  def tool(description: str):
    return lambda fn: tools.append(_strict(Tool.from_function(fn, description=description)))

  kmax = service.memory.config.ear.num_candidates  # K
  text = Annotated[StrictStr, Field(max_length=MAX_TEXT_CHARS)]
  short = Annotated[StrictStr, Field(max_length=MAX_SCOPE_CHARS)]
  k_arg = Annotated[StrictInt, Field(description=f"How many memories at most (1-{kmax}); fewer "
                                     "when the scope holds fewer.", ge=1, le=kmax)]

  @tool(description=(
      "Store new long-term memories (facts, conversation turns, preferences). One memory per "
      "list entry, each a self-contained sentence or short passage (at most "
      f"{MAX_TEXT_CHARS} characters, {MAX_TEXTS} per call). Returns their ids."))
  async def remember(texts: Annotated[list[text], Field(
      description="The memories to store, one string each.", max_length=MAX_TEXTS)],
                     scope: Annotated[Optional[short], Field(description=(
                         "Optional scope (e.g. 'user-42' or a project name) that keeps memories "
                         "apart: recall and search with a scope only see memories stored in that "
                         "scope."))] = None,
                     dates: Annotated[Optional[list[short]], Field(description=(
                         "Optional date of each memory (when it was said or happened, e.g. "
                         "'2023-05-08' or '1:56 pm on 8 May, 2023'); default: now."),
                         max_length=MAX_TEXTS)] = None) -> dict:
    return await run(service.remember, texts, scope, dates)

  @tool(description=(
      "Retrieve memories relevant to a question BEFORE answering it. Returns a retrieval_id and "
      "memories (id, text, date). After answering you MUST call `cite(retrieval_id, "
      "answer=<your answer>)` with this retrieval_id and your answer (and used_ids, the ids of the "
      "memories you used, if you know them): that is how the memory learns what is useful. If "
      "these memories were not enough, call `cite` all the same (your best answer, or "
      "used_ids=[]) and call `recall` again with exactly the same question to get another "
      "selection (a few rounds per question). learn=false: answer WITHOUT teaching the memory "
      "(e.g. at an evaluation); each call with the same question shows the next page of its "
      "best-ranked memories, cite each page as above, and answer from `answer_ids` (the "
      "memories you cited first, then the best-ranked)."))
  async def recall(question: Annotated[text, Field(
      description="The question you need to answer, in natural language.")],
                   k: k_arg = 5,
                   scope: Annotated[Optional[short], Field(description=(
                       "Optional scope to recall from (as given to remember); default: every "
                       "scope."))] = None,
                   learn: Annotated[StrictBool, Field(description=(
                       "true (default): your citations teach the memory; false: test time, "
                       "pages of the current ranking, nothing learnt."))] = True) -> dict:
    return await run(service.recall, question, k, scope, learn)

  @tool(description=(
      "Call this after answering from a `recall` result, once per retrieval_id: send your answer "
      "(`answer`, the text you answered with; the memory finds which recalled memories it drew "
      "on) and/or the ids of the recalled memories your answer used (`used_ids`; an empty list "
      "if none helped). The memory learns from it which memories help."))
  async def cite(retrieval_id: Annotated[short, Field(
      description="The retrieval_id returned by recall.")],
                 used_ids: Annotated[Optional[list[text]], Field(
                     description="Ids of the recalled memories the answer used (optional when "
                                 "you send the answer).", max_length=MAX_IDS)] = None,
                 answer: Annotated[Optional[text], Field(
                     description=f"Your answer to the recalled question, as you gave it (at most "
                                 f"{MAX_TEXT_CHARS} characters).")] = None) -> dict:
    return await run(service.cite, retrieval_id, used_ids, answer)

  @tool(description=(
      "Look up memories for a query without learning (no citation needed): the memory's current "
      "best ranking. Use `recall` + `cite` when answering a question."))
  async def search(question: Annotated[text, Field(description="The query.")],
                   k: k_arg = 5,
                   scope: Annotated[Optional[short], Field(description=(
                       "Optional scope to search (as given to remember); default: every "
                       "scope."))] = None) -> dict:
    return await run(service.search, question, k, scope)

  @tool(description=(
      "Permanently delete memories by id (e.g. wrong or outdated facts, or at the user's request). "
      "They are never recalled again and are erased from the saved memory."))
  async def forget(ids: Annotated[list[text], Field(
      description="Ids of the memories to delete.", max_length=MAX_IDS)]) -> dict:
    return await run(service.forget, ids)

  @tool(description="Sizes and counters of the memory: memories stored, retrievals, "
            "citations, learner steps, learner saves, micro-batching, and what search serves "
            "now (the adapter or the first stage, and the guard's evidence).")
  async def stats() -> dict:
    return await run(service.stats)

  return FastMCP("ear-memory", instructions=INSTRUCTIONS, host=host, port=port,
                 log_level="WARNING", transport_security=mcp_http.transport_security(host, port),
                 tools=tools)


def _strict(tool):
  """`tool` refusing, by name, the arguments it does not take (`additionalProperties: false`)."""
  from pydantic import ConfigDict, model_validator  # pylint: disable=g-import-not-at-top
  base = tool.fn_metadata.arg_model
  names = sorted(field.alias or name for name, field in base.model_fields.items())

  def known(cls, data):
    del cls
    unknown = sorted(set(data) - set(names)) if isinstance(data, dict) else []
    if unknown:
      raise ValueError(f"unknown argument(s) {unknown} for tool {tool.name!r}; it takes {names}")
    return data

  strict = type(base.__name__, (base,), {
      "__module__": base.__module__, "model_config": ConfigDict(**base.model_config,
                                                                extra="forbid"),
      "known_arguments": model_validator(mode="before")(classmethod(known))})
  tool.fn_metadata.arg_model = strict
  tool.parameters = strict.model_json_schema(by_alias=True)
  return tool
