"""An EAR `Memory` served over the Model Context Protocol: the agent's own LLM is the critic.

An MCP client (a desktop or IDE assistant, an agent framework) calls six tools:

* `remember(texts, scope?, dates?)` -> the new memories' ids (in `scope`, e.g. one user's; dated
  now unless `dates` are given);
* `recall(question, k, scope?)` -> a retrieval id and `k` memories (id, text, date) of ONE Explorer
  round over the memories of `scope` (every scope when absent); asking the same question again in
  the same scope (after `cite`) plays the next round of the same session, so a question's `T`
  rounds are one training query (Eq. (11)-(14)), as `Memory` defines;
* `cite(retrieval_id, used_ids?, answer?)` -> that round's feedback: the memories the answer used
  are +1, the others shown -1. The agent's LLM is the critic: it names the ids it used, or just
  sends its answer, whose used memories the answer rule finds (`Memory.feedback(answer=...)`,
  issue 28: no citation and no extra LLM call), or both (their union); the descriptions ask the
  model to call it with its answer after every answer;
* `search(question, k, scope?)` -> the adapter-only top-k (no exploration, no learning);
* `forget(ids)` -> `Memory.delete` (gone from results, sessions, the replay buffer, the next
  checkpoint's bytes);
* `stats()` -> sizes, counters, the learner's progress.

`MemoryService` is the transport-free core (thread-safe; the tools run in worker threads, so the
HTTP transport serves several clients at once): bounded, validated input (a bad call is an MCP tool
error with a clear message, and the server keeps serving), retrieval ids that name the server run
that issued them (one from before a restart is refused by name, never confused with a new one),
and durability: the memory is saved atomically (`Memory.save`) after every `save_every` changes
(remember, cite, forget) and on shutdown, so a crash loses at most the last `save_every - 1`
changes and a restart continues from the directory. `build_server` wraps it in the `mcp` SDK's
`FastMCP` (strict argument types); `mcp_stdio.serve_stdio` runs it on stdio (strict UTF-8; every request
with an id is answered, a malformed one with a JSON-RPC error) and `serve_http` on streamable HTTP
(loopback by default with Host / Origin checks, optional bearer token).

Symbols: `k` memories per slate, `K` candidates, `T` Explorer rounds per question.
"""
import collections
import hmac
import ipaddress
import pathlib
import secrets
import sys
import threading
import time
from typing import Any, Optional

MAX_TEXT_CHARS = 20_000  # one memory or question
MAX_TEXTS = 512  # memories per `remember`
MAX_IDS = 1_000  # ids per `cite` / `forget`
MAX_OPEN = 4096  # retrievals remembered by id (older ones are reported as expired)
MAX_SCOPE_CHARS = 200  # one scope name
MAX_SCOPES = 64  # scope names per query

INSTRUCTIONS = (
    "A long-term memory that learns which memories help you. Store facts with `remember`. Before "
    "answering a question that may depend on earlier conversations, call `recall` with the "
    "question; answer from the memories it returns, then ALWAYS call `cite(retrieval_id, "
    "answer=<your answer>)` with your answer as you gave it (and, if you know them, used_ids= the "
    "ids of the memories your answer used): the memory learns from your answer which memories "
    "helped. If the memories were not enough, call `recall` again with the SAME question (after "
    "`cite`) to see a different selection. `search` looks up memories without learning; `forget` "
    "deletes memories permanently.")


class ToolInputError(ValueError):
  """Bad tool input: reported to the client as a tool error with this message."""


def _check_str(value, name: str, max_chars: int = MAX_TEXT_CHARS,
               hint: str = "split it into smaller memories") -> str:
  if not isinstance(value, str):
    raise ToolInputError(f"{name} must be a string, got {type(value).__name__}")
  if not value.strip():
    raise ToolInputError(f"{name} is empty")
  if len(value) > max_chars:
    raise ToolInputError(f"{name} has {len(value)} characters, more than the limit of {max_chars}; "
                         f"{hint}")
  return value


def _check_list(value, name: str, limit: int, allow_empty: bool = False) -> list[str]:
  if isinstance(value, str):
    value = [value]
  if not isinstance(value, (list, tuple)):
    raise ToolInputError(f"{name} must be a list of strings, got {type(value).__name__}")
  if not value and not allow_empty:
    raise ToolInputError(f"{name} is empty")
  if len(value) > limit:
    raise ToolInputError(f"{name} has {len(value)} entries, more than the limit of {limit} per "
                         "call")
  for i, v in enumerate(value):
    if not isinstance(v, str):
      raise ToolInputError(f"{name}[{i}] must be a string, got {type(v).__name__}")
  return list(value)


def _check_scope(scope, many: bool):
  """None, a scope name, or (when `many`) a list of names; ToolInputError otherwise."""
  if scope is None:
    return None
  if many and isinstance(scope, (list, tuple)):
    names = _check_list(scope, "scope", MAX_SCOPES)
    return [_check_str(n, f"scope[{i}]", MAX_SCOPE_CHARS) for i, n in enumerate(names)]
  if not isinstance(scope, str):
    raise ToolInputError(f"scope must be a string{' or a list of strings' if many else ''}, got "
                         f"{type(scope).__name__}")
  return _check_str(scope, "scope", MAX_SCOPE_CHARS)


def _scope_key(scope) -> tuple:
  """The key of a scope spec (None: every scope) in the service's question map."""
  return () if scope is None else ((scope,) if isinstance(scope, str) else tuple(sorted(scope)))


def _check_k(k, num_candidates: int) -> int:
  if isinstance(k, bool) or not isinstance(k, int):
    raise ToolInputError(f"k must be an integer, got {type(k).__name__}")
  if not 1 <= k <= num_candidates:
    raise ToolInputError(f"k must be between 1 and {num_candidates}, got {k}")
  return k


def is_loopback(host: str) -> bool:
  """True for 'localhost' and loopback addresses (127.0.0.0/8, ::1)."""
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host.strip("[]")).is_loopback
  except ValueError:
    return False


def resume_questions(memory) -> dict:
  """{(question, scope key): a `Retrieval` to continue} for the open sessions of a (loaded)
  memory, so that the same question asked in the same scope after a restart plays its session's
  next round (a session keeps the scope names it was opened with, `Session.scope`). A round shown but never
  cited before the restart is discarded (its retrieval id named the earlier run)."""
  from ear_jax.agent.memory.sessions import Retrieval  # pylint: disable=g-import-not-at-top
  out = {}
  with memory._lock:  # pylint: disable=protected-access
    sessions = memory._sessions  # pylint: disable=protected-access
    for sid, s in sorted(sessions.by_id.items()):
      if s.closed or not s.query:
        continue
      if s.open_id >= 0:
        memory.discard(s.open_id)
      if not s.consumed:
        continue
      out[(s.query, _scope_key(list(s.scope) or None))] = Retrieval(
          retrieval_id=int(s.consumed[-1]), session_id=sid, round=s.rounds, query=s.query, ids=(),
          texts=(), stores=(), scores=(), explore=True, memory_token=sessions.token,
          generation=sessions.generation)
  return out


class MemoryService:
  """The tools' logic over one persistent `Memory` (thread-safe, transport-free).

  Args:
    memory: the `Memory` served.
    memory_dir: its checkpoint directory (None: never saved, for tests).
    save_every: save after this many changes (remember / cite / forget calls); >= 1.
    save_idle_s: also save once no tool changed the memory for this long (0: never; a background
      thread, only with a `memory_dir`).
  """

  def __init__(self, memory, memory_dir=None, save_every: int = 20, save_idle_s: float = 0.0):
    if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1:
      raise ValueError(f"save_every must be an int >= 1, got {save_every!r}")
    if not save_idle_s >= 0:
      raise ValueError(f"save_idle_s must be >= 0, got {save_idle_s!r}")
    self.memory = memory
    self.memory_dir = None if memory_dir is None else pathlib.Path(memory_dir).expanduser()
    self.save_every = save_every
    self.run_token = secrets.token_hex(4)  # names this server run in its retrieval ids
    self._lock = threading.RLock()  # the service's maps and counters (the memory has its own)
    # `Memory` encodes outside its lock, and a Hugging Face fast tokenizer used by two threads at
    # once fails ("Already borrowed"): calls that may encode take this lock (after `_lock`).
    self._encode_lock = threading.Lock()
    self._save_lock = threading.Lock()  # one save at a time (taken before `_lock`)
    self._retrievals = collections.OrderedDict()  # retrieval id -> Retrieval
    self._by_question: dict[tuple, Any] = {}  # (question, scope key) -> its latest Retrieval
    self.changes = 0  # since the last save
    self.touched = False  # retrievals since the last save (sessions to keep at shutdown)
    self.saves = 0
    self.closed = False
    self._by_question.update(resume_questions(memory))
    self._last_change = time.monotonic()
    self._stop = threading.Event()
    self.closing = False  # set when the final save starts (the SIGTERM handler waits for it)
    if save_idle_s > 0 and self.memory_dir is not None:
      threading.Thread(target=self._idle_saver, args=(float(save_idle_s),), daemon=True,
                       name="ear-mcp-idle-save").start()

  def _idle_saver(self, idle_s: float) -> None:
    """Saves once no tool changed the memory for `idle_s` seconds (so a shutdown rarely has
    anything left to write: MCP clients kill a server that is slow to exit)."""
    while not self._stop.wait(min(idle_s, 0.5)):
      with self._lock:
        pending = self.changes or self.touched
        quiet = time.monotonic() - self._last_change >= idle_s
      if pending and quiet and not self.closing:
        try:
          self.save()
        except Exception as e:  # pylint: disable=broad-except  (the next save retries; keep serving)
          print(f"ear-mcp: background save failed: {type(e).__name__}: {e}", file=sys.stderr)

  # ----------------------------------------------------------------------------------------------
  # helpers

  def _rid(self, r) -> str:
    rid = f"{self.run_token}-{r.retrieval_id}"
    with self._lock:
      self._retrievals[rid] = r
      while len(self._retrievals) > MAX_OPEN:
        self._retrievals.popitem(last=False)
    return rid

  def _resolve(self, retrieval_id):
    if not isinstance(retrieval_id, str):
      raise ToolInputError(f"retrieval_id must be a string, got {type(retrieval_id).__name__}")
    token, _, num = retrieval_id.partition("-")
    if not num.isdigit():
      raise ToolInputError(f"retrieval_id {retrieval_id[:40]!r} is not a retrieval id returned by "
                           "recall")
    if token != self.run_token:
      raise ToolInputError(f"retrieval_id {retrieval_id[:40]!r} is from an earlier run of this server "
                           "(it restarted since) or from another server: call recall again")
    with self._lock:
      r = self._retrievals.get(retrieval_id)
    if r is None:
      raise ToolInputError(f"unknown or expired retrieval_id {retrieval_id[:40]!r}: call recall again")
    return r

  def _changed(self, n: int = 1) -> None:
    with self._lock:
      self.changes += n
      self._last_change = time.monotonic()
      due = self.changes >= self.save_every
    if due:
      self.save(when_due=True)

  def _slate(self, r) -> list[dict]:
    """The memories of a retrieval: id, text and date (a memory deleted meanwhile: no date)."""
    try:  # one lookup for the slate
      dates = [rec["date"] for rec in self.memory.get(list(r.ids))]
    except ValueError:  # one was deleted since (`forget` in another thread): each on its own
      dates = []
      for i in r.ids:
        try:
          dates.append(self.memory.get([i])[0]["date"])
        except ValueError:
          dates.append("")
    return [{"id": i, "text": t, "date": d} for i, t, d in zip(r.ids, r.texts, dates)]

  # ----------------------------------------------------------------------------------------------
  # tools

  def remember(self, texts, scope=None, dates=None) -> dict:
    texts = _check_list(texts, "texts", MAX_TEXTS)
    for i, t in enumerate(texts):
      _check_str(t, f"texts[{i}]")
    scope = _check_scope(scope, many=False)
    if dates is not None:
      dates = _check_list(dates, "dates", MAX_TEXTS)
      if len(dates) != len(texts):
        raise ToolInputError(f"dates has {len(dates)} entries for {len(texts)} texts: give one "
                             "date per text, or none (then they are dated now)")
      for i, d in enumerate(dates):
        _check_str(d, f"dates[{i}]", MAX_SCOPE_CHARS)
    with self._encode_lock:
      try:
        ids = self.memory.add(texts, scope=scope, dates=dates)
      except ValueError as e:
        raise ToolInputError(str(e)) from None
    self._changed()
    return {"ids": ids}

  def recall(self, question, k: int = 5, scope=None) -> dict:
    question = _check_str(question, "question")
    k = _check_k(k, self.memory.config.num_candidates)
    scope = _check_scope(scope, many=True)
    key = (question, _scope_key(scope))
    with self._lock:  # one question's rounds are played in order
      prev, r = self._by_question.get(key), None
      if prev is not None:
        try:
          self.memory.discard(prev)  # an earlier round never cited: shown, no feedback
        except ValueError:
          pass
        try:
          r = self.memory.retrieve(continue_from=prev, k=k, explore=True)
        except ValueError:  # its T rounds are done, or the session was closed / evicted
          r = None
      if r is None:
        with self._encode_lock:
          try:
            r = self.memory.retrieve(question, k=k, explore=True, scope=scope)
          except ValueError as e:  # e.g. fewer than k memories in the scope
            raise ToolInputError(str(e)) from None
      self._by_question[key] = r
      self.touched = True
      self._last_change = time.monotonic()
      while len(self._by_question) > MAX_OPEN:
        self._by_question.pop(next(iter(self._by_question)))
    T = self.memory.config.num_rounds
    return {"retrieval_id": self._rid(r), "round": r.round, "rounds_per_question": T,
            "memories": self._slate(r),
            "next": "answer from these memories, then call cite(retrieval_id, answer=<your "
                    "answer>) (and used_ids=<the ids you used>, if you know them)"}

  def cite(self, retrieval_id, used_ids=None, answer=None) -> dict:
    """A round's feedback: `used_ids` (the memories the answer used), `answer` (the agent's
    answer: the memories it draws on by the answer rule), or both (their union;
    `Memory.feedback`); neither is a tool error."""
    if used_ids is None and answer is None:
      raise ToolInputError("cite needs used_ids or answer (or both): the ids of the recalled "
                           "memories your answer used, or your answer itself")
    used = [] if used_ids is None else _check_list(used_ids, "used_ids", MAX_IDS,
                                                   allow_empty=True)
    if answer is not None:
      answer = _check_str(answer, "answer", hint="send the answer as given, shortened")
    r = self._resolve(retrieval_id)
    try:
      if answer is None:
        trained = self.memory.feedback(r, used)
      else:
        with self._encode_lock:  # (the answer is embedded)
          trained = self.memory.feedback(r, used, answer=answer)
    except ValueError as e:
      raise ToolInputError(str(e)) from None
    self._changed()
    T = self.memory.config.num_rounds
    return {"recorded": True, "round": r.round, "rounds_left": max(T - r.round, 0),
            "learner_step": bool(trained)}

  def search(self, question, k: int = 5, scope=None) -> dict:
    question = _check_str(question, "question")
    k = _check_k(k, self.memory.config.num_candidates)
    scope = _check_scope(scope, many=True)
    with self._encode_lock:
      try:
        r = self.memory.search(question, k, scope=scope)
      except ValueError as e:  # e.g. fewer than k memories in the scope
        raise ToolInputError(str(e)) from None
    return {"memories": self._slate(r)}

  def forget(self, ids) -> dict:
    ids = _check_list(ids, "ids", MAX_IDS)
    deleted = self.memory.delete(ids)
    self._changed()
    return {"deleted": deleted}

  def stats(self) -> dict:
    m = self.memory
    st = dict(m.stats)
    return {"memories": len(m), "candidates": m.candidates,
            "num_candidates": m.config.num_candidates, "rounds_per_question": m.config.num_rounds,
            "learner_steps": int(st.get("learner_steps", 0)),
            "feedback": int(st.get("feedback", 0)),
            "answer_feedback": int(st.get("answer_feedback", 0)),
            "retrievals": int(st.get("retrievals", 0)),
            "memories_deleted": int(st.get("memories_deleted", 0)),
            "pending_sessions": m.num_pending, "unsaved_changes": self.changes,
            "saves": self.saves}

  # ----------------------------------------------------------------------------------------------
  # durability

  def save(self, when_due: bool = False) -> None:
    """Saves now (atomically; `Memory.save`) when there is a directory and unsaved changes.

    Saves run one at a time, and each subtracts exactly the changes it counted before its
    snapshot (all of them are in it), so a change that arrives during a save is counted by the
    next one, never by two (the counter never goes below the true number of unsaved changes).
    `when_due`: only when `save_every` changes are still unsaved once a running save has ended
    (a change that made the count due while another save ran, which may have covered it)."""
    if self.memory_dir is None:
      return
    with self._save_lock:
      with self._lock:
        n, touched = self.changes, self.touched
        if not (n or touched) or (when_due and n < self.save_every):
          return
        self.touched = False
      try:
        self.memory.save(self.memory_dir)
      except BaseException:
        with self._lock:
          self.touched = self.touched or touched
        raise
      with self._lock:
        self.changes -= n
        self.saves += 1

  def close(self) -> None:
    """The final save (shutdown: stdin EOF, SIGTERM); idempotent."""
    with self._lock:
      if self.closed:
        return
      self.closed = self.closing = True
    self._stop.set()
    self.save()


def open_memory(memory_dir, *, method: str = "ear_tuned", candidates: str = "dense",
                encoder: str = "minilm", cache_dir=None, seed: int = 0):
  """The `Memory` at `memory_dir`: loaded when it holds a checkpoint (its saved method and first
  stage win; a different `candidates` is an error), else a new one with `method`'s config and
  hyperparameters (`EARConfig.for_method`, `hparams_for_method`)."""
  from ear_jax.agent.memory import persistence  # pylint: disable=g-import-not-at-top
  from ear_jax.agent.memory.encoder_slot import EncoderSlot  # pylint: disable=g-import-not-at-top
  from ear_jax.agent.memory import Memory  # pylint: disable=g-import-not-at-top
  from ear_jax.core.config import EARConfig, hparams_for_method  # pylint: disable=g-import-not-at-top
  root = persistence.checkpoint_dir(pathlib.Path(memory_dir).expanduser())
  from ear_jax.io.checkpoints import CheckpointStore  # pylint: disable=g-import-not-at-top
  if root.is_dir() and CheckpointStore(root).latest_step() is not None:
    m = Memory.load(root, encoder="saved" if encoder == "minilm" else encoder)
    if m.candidates != candidates:
      raise ValueError(f"{str(root)!r} holds a memory with candidates={m.candidates!r}, not "
                       f"{candidates!r}: pass --candidates={m.candidates} (or another directory)")
    return m
  slot = EncoderSlot(encoder)
  dim = slot.dim
  if dim is None:
    dim = slot.get(None).dim
  config = EARConfig.for_method(method, dim=dim)
  m = Memory(slot, config=config, hparams=hparams_for_method(method), seed=seed,
             cache_dir=cache_dir, candidates=candidates)
  m.claim(root)  # (a second server on this directory is refused, naming this one's pid)
  return m


def _run(service: MemoryService, fn, *args):
  """Runs a tool in a worker thread; bad input -> ToolError (the server keeps serving)."""
  import anyio  # pylint: disable=g-import-not-at-top
  from mcp.server.fastmcp.exceptions import ToolError  # pylint: disable=g-import-not-at-top

  async def go():
    try:
      return await anyio.to_thread.run_sync(fn, *args)
    except (ValueError, TypeError, KeyError) as e:  # ToolInputError, and Memory's input errors
      raise ToolError(f"{type(e).__name__}: {e}") from None
  return go()


def _transport_security(host: str, port: int):
  """The Host / Origin checks of HTTP on a loopback `host` (DNS rebinding: a web page whose name
  now resolves to this address): that address (for 127.0.0.1, localhost and ::1: the three names)
  at `port`; a wrong Host is a 421, a wrong Origin a 403. None (no check) elsewhere: a
  non-loopback address needs the bearer token, which such a page cannot send."""
  from mcp.server.transport_security import TransportSecuritySettings  # pylint: disable=g-import-not-at-top
  if not is_loopback(host):
    return None
  if host in ("127.0.0.1", "localhost", "::1", "[::1]"):
    names = ["127.0.0.1", "localhost", "[::1]"]
  else:
    name = host.strip("[]")
    names = [f"[{name}]" if ":" in name else name]
  return TransportSecuritySettings(
      enable_dns_rebinding_protection=True, allowed_hosts=[f"{n}:{port}" for n in names],
      allowed_origins=[f"http://{n}:{port}" for n in names])


def build_server(service: MemoryService, host: str = "127.0.0.1", port: int = 8000):
  """A `FastMCP` server with the six tools over `service` (tools run in worker threads).

  Arguments are strict JSON types (`StrictInt`, `StrictStr`): `k=true` or `k="5"` is a tool error,
  never coerced to 1 or 5. HTTP on a loopback address checks the Host and Origin headers against
  that address and `port` (DNS rebinding), on 127.0.0.2 as on 127.0.0.1.
  """
  from typing import Annotated  # pylint: disable=g-import-not-at-top
  from mcp.server.fastmcp import FastMCP  # pylint: disable=g-import-not-at-top
  from pydantic import Field, StrictInt, StrictStr  # pylint: disable=g-import-not-at-top

  mcp = FastMCP("ear-memory", instructions=INSTRUCTIONS, host=host, port=port,
                log_level="WARNING", transport_security=_transport_security(host, port))
  kmax = service.memory.config.num_candidates

  scope_doc = ("Optional scope (e.g. 'user-42' or a project name) that keeps memories apart: "
               "recall and search with a scope only see memories stored in that scope.")

  @mcp.tool(description=(
      "Store new long-term memories (facts, conversation turns, preferences). One memory per "
      "list entry, each a self-contained sentence or short passage (at most "
      f"{MAX_TEXT_CHARS} characters, {MAX_TEXTS} per call). Returns their ids."))
  async def remember(texts: Annotated[list[StrictStr], Field(
      description="The memories to store, one string each.")],
                     scope: Annotated[Optional[StrictStr], Field(description=scope_doc)] = None,
                     dates: Annotated[Optional[list[StrictStr]], Field(description=(
                         "Optional date of each memory (when it was said or happened, e.g. "
                         "'2023-05-08' or '1:56 pm on 8 May, 2023'); default: now."))] = None
                     ) -> dict:
    return await _run(service, service.remember, texts, scope, dates)

  @mcp.tool(description=(
      "Retrieve memories relevant to a question BEFORE answering it. Returns a retrieval_id and "
      "memories (id, text, date). After answering you MUST call `cite(retrieval_id, "
      "answer=<your answer>)` with this retrieval_id and your answer (and used_ids, the ids of the "
      "memories you used, if you know them): that is how the memory learns what is useful. If "
      "these memories were not enough, call `cite` all the same (your best answer, or "
      "used_ids=[]) and call `recall` again with exactly the same question to get another "
      "selection (a few rounds per question)."))
  async def recall(question: Annotated[StrictStr, Field(
      description="The question you need to answer, in natural language.")],
                   k: Annotated[StrictInt, Field(description=f"How many memories (1-{kmax}).",
                                                 ge=1, le=kmax)] = 5,
                   scope: Annotated[Optional[StrictStr], Field(description=(
                       "Optional scope to recall from (as given to remember); default: every "
                       "scope."))] = None) -> dict:
    return await _run(service, service.recall, question, k, scope)

  @mcp.tool(description=(
      "Call this after answering from a `recall` result, once per retrieval_id: send your answer "
      "(`answer`, the text you answered with; the memory finds which recalled memories it drew "
      "on) and/or the ids of the recalled memories your answer used (`used_ids`; an empty list "
      "if none helped). The memory learns from it which memories help."))
  async def cite(retrieval_id: Annotated[StrictStr, Field(
      description="The retrieval_id returned by recall.")],
                 used_ids: Annotated[Optional[list[StrictStr]], Field(
                     description="Ids of the recalled memories the answer used (optional when "
                                 "you send the answer).")] = None,
                 answer: Annotated[Optional[StrictStr], Field(
                     description=f"Your answer to the recalled question, as you gave it (at most "
                                 f"{MAX_TEXT_CHARS} characters).")] = None) -> dict:
    return await _run(service, service.cite, retrieval_id, used_ids, answer)

  @mcp.tool(description=(
      "Look up memories for a query without learning (no citation needed): the memory's current "
      "best ranking. Use `recall` + `cite` when answering a question."))
  async def search(question: Annotated[StrictStr, Field(description="The query.")],
                   k: Annotated[StrictInt, Field(description=f"How many memories (1-{kmax}).",
                                                 ge=1, le=kmax)] = 5,
                   scope: Annotated[Optional[StrictStr], Field(description=(
                       "Optional scope to search (as given to remember); default: every "
                       "scope."))] = None) -> dict:
    return await _run(service, service.search, question, k, scope)

  @mcp.tool(description=(
      "Permanently delete memories by id (e.g. wrong or outdated facts, or at the user's request). "
      "They are never recalled again and are erased from the saved memory."))
  async def forget(ids: Annotated[list[StrictStr], Field(
      description="Ids of the memories to delete.")]) -> dict:
    return await _run(service, service.forget, ids)

  @mcp.tool(description="Sizes and counters of the memory: memories stored, retrievals, "
            "citations, learner steps, unsaved changes.")
  async def stats() -> dict:
    return await _run(service, service.stats)

  return mcp


class BearerAuth:
  """ASGI middleware: 401 unless `Authorization: Bearer <token>` (compared in constant time)."""

  def __init__(self, app, token: str):
    self.app, self._token = app, token.encode()

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http":
      got = dict(scope.get("headers") or []).get(b"authorization", b"")
      if not hmac.compare_digest(got, b"Bearer " + self._token):
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"text/plain"),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": b"missing or wrong bearer token"})
        return
    await self.app(scope, receive, send)


def serve_http(mcp, host: str, port: int, token: Optional[str]) -> None:
  """Streamable HTTP at `http://host:port/mcp` (uvicorn), behind `BearerAuth` when `token`."""
  import uvicorn  # pylint: disable=g-import-not-at-top
  app = mcp.streamable_http_app()
  if token:
    app = BearerAuth(app, token)
  uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).run()
