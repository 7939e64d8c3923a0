"""Benchmark loaders: LoCoMo, LongMemEval and a user JSONL format, turned into memory banks + queries.

A loader returns a `Corpus`: one `Bank` of memories per conversation (LoCoMo), per question
(LongMemEval) or per named bank (JSONL), and the evaluable `Query`s in file order, each pointing at
its bank (`group`) and naming its gold memory ids. `stats` counts everything dropped or excluded.
Embedding and candidate selection happen in `ear_jax.data.candidates` (`load_benchmark`).

Memory stores: 0 = dialogue turns (episodic), 1 = observations (semantic, Section 5). An observation
lists the dialogue ids it references (`Bank.refs`); it is gold for a query when it, or any dialogue id
it references, is gold (`gold_mask`).

LoCoMo (`locomo10.json`): bank = the conversation's dialogue turns, text `"<speaker>: <text>"` plus
`" [image: <blip_caption>]"` when the turn shares an image, id = the `dia_id`; observations
(`observation.session_N_observation.<speaker> = [[fact, dia_id(s)], ...]`) are store 1 with ids
`"O<N>:<j>"`. QA categories 1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop are kept;
5 (adversarial) is dropped. Evidence ids are normalised (`normalize_evidence`), ids that do not
name a turn of the conversation are dropped and counted; queries left without gold are excluded and
counted (an EMPTY evidence list is a known quirk: the query is dropped and counted; an ABSENT
`evidence` field is an error).

LongMemEval (`longmemeval_s*.json[.gz]`, `_m`, `_oracle`, cleaned releases): bank = the USER turns of
the question's own haystack, id = `session_id + "_" + (i + 1)` with i counting all turns of the
session; gold = user turns with `has_answer`; `_abs` questions and questions without a gold user turn
(e.g. assistant-only evidence) are excluded and counted; category = `question_type`.

User JSONL format (one JSON object per line; blank lines and lines starting with `#` are skipped;
full description in docs/jsonl_format.md):

  {"type": "memory", "id": "m1", "text": "I adopted a cat named Luna.", "bank": "alice",
   "store": "dialogue"}
  {"type": "memory", "id": "o1", "text": "Alice has a cat.", "bank": "alice",
   "store": "observation", "refs": ["m1"]}
  {"type": "query", "id": "q1", "text": "What is my cat called?", "gold": ["m1"], "bank": "alice",
   "category": "single-hop"}

`type`, `id` (memories), `text` and `gold` (queries) are required; `bank` defaults to `"default"`,
`store` to `"dialogue"` (`"episodic"` is a synonym; `"observation"`/`"semantic"` is store 1),
`category` to `"all"`, query `id` to `"q<line number>"`. A query searches only its own bank.

Data directory: `resolve_data_dir(data_dir)` = the argument, else `$EAR_DATA_DIR`, else
`~/.cache/ear_jax/data` (`$XDG_CACHE_HOME/ear_jax/data`).

Split (Section 4.4): `split_indices(n, seed)` permutes the queries with `np.random.default_rng(seed)`;
the first `floor(0.8 n)` are the online training stream, the rest the test set.
"""
from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import os
import pathlib
import re
from typing import Any, Sequence

import numpy as np

LOCOMO_CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
LOCOMO_ADVERSARIAL = 5
LOCOMO_FILE = "locomo10.json"
# Looked up in this order; the first that exists is used.
LONGMEMEVAL_FILES = (
    "longmemeval_s_cleaned.json", "longmemeval_s_cleaned.json.gz",
    "longmemeval_s.json", "longmemeval_s.json.gz", "longmemeval_s.reassembled.json.gz",
)
STORE_DIALOGUE = 0
STORE_OBSERVATION = 1
_STORE_NAMES = {"dialogue": 0, "episodic": 0, "observation": 1, "semantic": 1}
_EVIDENCE_RE = re.compile(r"^D:?(\d+):0*(\d+)$")
_SESSION_RE = re.compile(r"^session_(\d+)$")


@dataclasses.dataclass
class Bank:
  """The memory bank of one conversation / question. `M` memories."""
  ids: list[str]  # [M] memory ids (unique in LoCoMo/JSONL; LongMemEval may repeat a session)
  texts: list[str]  # [M]
  stores: np.ndarray  # [M] int8, 0 = dialogue, 1 = observation
  refs: list[tuple[str, ...]]  # [M] dialogue ids an observation references; () for dialogue turns

  def __len__(self):
    return len(self.ids)


@dataclasses.dataclass
class Query:
  id: str
  text: str
  gold: tuple[str, ...]  # gold memory ids (LoCoMo: normalised, resolvable dia_ids)
  category: str
  group: int  # index of its bank in `Corpus.banks`


@dataclasses.dataclass
class Corpus:
  name: str
  banks: list[Bank]
  queries: list[Query]  # evaluable queries, file order
  stats: dict[str, Any]


def resolve_data_dir(data_dir=None) -> pathlib.Path:
  """`data_dir`, else `$EAR_DATA_DIR`, else the user cache dir `~/.cache/ear_jax/data`."""
  if data_dir:
    return pathlib.Path(data_dir).expanduser()
  if os.environ.get("EAR_DATA_DIR"):
    return pathlib.Path(os.environ["EAR_DATA_DIR"]).expanduser()
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "ear_jax" / "data"


def find_benchmark_file(name: str, data_dir=None) -> pathlib.Path:
  """The benchmark file of `name` ('locomo' | 'longmemeval') in the resolved data directory.

  Raises:
    FileNotFoundError: saying which file to put where (or to run `python -m experiments.download`).
  """
  d = resolve_data_dir(data_dir)
  if name == "locomo":
    names = (LOCOMO_FILE,)
  elif name == "longmemeval":
    names = LONGMEMEVAL_FILES
  else:
    raise ValueError(f"unknown benchmark {name!r}; expected 'locomo' or 'longmemeval'")
  for n in names:
    if (d / n).is_file():
      return d / n
  from ear_jax.data import download  # pylint: disable=g-import-not-at-top
  raise FileNotFoundError(download.missing_file_message(name, d))


def _read_json(path) -> Any:
  path = pathlib.Path(path)
  try:
    if path.suffix == ".gz":
      with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: invalid JSON (truncated or corrupt file?): {e}") from e
  except (EOFError, gzip.BadGzipFile, OSError) as e:
    if isinstance(e, FileNotFoundError):
      raise
    raise ValueError(f"{path}: cannot read (truncated or corrupt file?): {e}") from e


def _field(obj: Any, key: str, where: str):
  if not isinstance(obj, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
  if key not in obj:
    raise ValueError(f"{where}: missing field {key!r}")
  return obj[key]


def normalize_evidence(raw) -> tuple[list[str], list[str]]:
  """Normalises LoCoMo evidence / observation references to `"D<session>:<turn>"` ids.

  A value may be a string or a list of strings; each string may hold several ids joined by `;`,
  `,` or spaces. Each token matching `D:?(\\d+):0*(\\d+)` becomes `D<s>:<t>` ("D:11:26" -> "D11:26",
  "D30:05" -> "D30:5"); other tokens (e.g. a bare "D") are returned as malformed.

  Returns:
    (normalised ids in order without repeats, malformed tokens).
  """
  items = raw if isinstance(raw, (list, tuple)) else [raw]
  ids, bad = [], []
  for item in items:
    for tok in re.split(r"[;,\s]+", str(item).strip()):
      if not tok:
        continue
      m = _EVIDENCE_RE.match(tok)
      if m is None:
        bad.append(tok)
        continue
      norm = f"D{int(m.group(1))}:{int(m.group(2))}"
      if norm not in ids:
        ids.append(norm)
  return ids, bad


def gold_mask(bank: Bank, gold: Sequence[str]) -> np.ndarray:
  """`[M]` bool: memory is gold when its id is gold or it references a gold dialogue id."""
  gold = set(gold)
  return np.array([i in gold or any(r in gold for r in refs)
                   for i, refs in zip(bank.ids, bank.refs)], bool)


def load_locomo(path, *, limit: int | None = None) -> Corpus:
  """LoCoMo (see module docstring). `limit`: only the first `limit` conversations."""
  path = pathlib.Path(path)
  data = _read_json(path)
  if not isinstance(data, list):
    raise ValueError(f"{path}: expected a JSON list of conversations")
  if limit is not None:
    data = data[:limit]
  banks, queries = [], []
  st = collections.Counter()
  per_cat = collections.Counter()
  dropped_ids, malformed = [], []
  for g, conv in enumerate(data):
    where = f"{path}: conversation {g}"
    sample_id = conv.get("sample_id", str(g)) if isinstance(conv, dict) else str(g)
    where = f"{path}: conversation {sample_id!r}"
    c = _field(conv, "conversation", where)
    qa = _field(conv, "qa", where)
    sessions = sorted(((int(m.group(1)), k) for k in c if (m := _SESSION_RE.match(k))
                       and isinstance(c[k], list)))
    ids, texts, stores, refs = [], [], [], []
    for _, key in sessions:
      st["sessions"] += 1
      for j, turn in enumerate(c[key]):
        w = f"{where}, {key} turn {j}"
        dia_id, speaker, text = (_field(turn, f, w) for f in ("dia_id", "speaker", "text"))
        t = f"{speaker}: {text}"
        if turn.get("blip_caption"):
          t += f" [image: {turn['blip_caption']}]"
        ids.append(str(dia_id))
        texts.append(t)
        stores.append(STORE_DIALOGUE)
        refs.append(())
    if not ids:
      raise ValueError(f"{where}: empty memory bank (no dialogue turns)")
    st["turns"] += len(ids)
    turn_ids = set(ids)
    obs = conv.get("observation") or {}
    for okey in sorted(obs, key=lambda k: int(re.findall(r"\d+", k)[0]) if re.findall(r"\d+", k) else 0):
      num = re.findall(r"\d+", okey)
      n_sess = num[0] if num else okey
      j = 0
      for speaker, facts in (obs[okey] or {}).items():
        for fact in facts:
          if not isinstance(fact, (list, tuple)) or len(fact) < 2:
            raise ValueError(f"{where}: observation {okey}/{speaker} entry {fact!r} is not [fact, dia_id]")
          r, bad = normalize_evidence(fact[1])
          good = tuple(x for x in r if x in turn_ids)
          if len(good) < len(r) or bad:
            st["observation_refs_unresolvable"] += len(r) - len(good) + len(bad)
          ids.append(f"O{n_sess}:{j}")
          texts.append(str(fact[0]))
          stores.append(STORE_OBSERVATION)
          refs.append(good)
          j += 1
          st["observations"] += 1
    banks.append(Bank(ids=ids, texts=texts, stores=np.asarray(stores, np.int8), refs=refs))
    for qi, item in enumerate(qa):
      w = f"{where}, qa item {qi}"
      cat = _field(item, "category", w)
      if cat == LOCOMO_ADVERSARIAL:
        st["queries_adversarial_dropped"] += 1
        continue
      if cat not in LOCOMO_CATEGORIES:
        raise ValueError(f"{w}: unknown category {cat!r}")
      question = _field(item, "question", w)
      evidence = _field(item, "evidence", w)
      st["queries"] += 1
      if not evidence:
        st["queries_empty_evidence_dropped"] += 1
        continue
      norm, bad = normalize_evidence(evidence)
      for e in (evidence if isinstance(evidence, list) else [evidence]):
        if normalize_evidence(e) != ([str(e)], []):  # not already one canonical "D<s>:<t>"
          st["evidence_entries_malformed"] += 1
      malformed.extend(bad)
      gold = tuple(x for x in norm if x in turn_ids)
      dropped = [x for x in norm if x not in turn_ids] + bad
      if dropped:
        st["evidence_ids_dropped"] += len(dropped)
        dropped_ids.extend(f"{sample_id}/{x}" for x in dropped)
      if not gold:
        st["queries_without_gold_excluded"] += 1
        continue
      category = LOCOMO_CATEGORIES[cat]
      per_cat[category] += 1
      queries.append(Query(id=f"{sample_id}/q{qi}", text=str(question), gold=gold,
                           category=category, group=g))
  stats = {
      "file": str(path),
      "conversations": len(banks),
      "sessions": st["sessions"],
      "turns": st["turns"],
      "observations": st["observations"],
      "queries": st["queries"],
      "queries_evaluable": len(queries),
      "queries_adversarial_dropped": st["queries_adversarial_dropped"],
      "queries_empty_evidence_dropped": st["queries_empty_evidence_dropped"],
      "queries_without_gold_excluded": st["queries_without_gold_excluded"],
      "evidence_entries_malformed": st["evidence_entries_malformed"],
      "evidence_ids_dropped": st["evidence_ids_dropped"],
      "evidence_ids_dropped_list": dropped_ids,
      "observation_refs_unresolvable": st["observation_refs_unresolvable"],
      "queries_per_category": dict(sorted(per_cat.items())),
  }
  return Corpus(name="locomo", banks=banks, queries=queries, stats=stats)


def load_longmemeval(path, *, limit: int | None = None) -> Corpus:
  """LongMemEval (see module docstring). `limit`: only the first `limit` questions of the file."""
  path = pathlib.Path(path)
  data = _read_json(path)
  if not isinstance(data, list):
    raise ValueError(f"{path}: expected a JSON list of questions")
  if limit is not None:
    data = data[:limit]
  banks, queries = [], []
  st = collections.Counter()
  per_type = collections.Counter()
  texts_seen = set()
  for g, item in enumerate(data):
    where = f"{path}: question {g}"
    qid = str(_field(item, "question_id", where))
    where = f"{path}: question {qid!r}"
    qtype = str(_field(item, "question_type", where))
    question = str(_field(item, "question", where))
    sids = _field(item, "haystack_session_ids", where)
    sessions = _field(item, "haystack_sessions", where)
    if len(sids) != len(sessions):
      raise ValueError(f"{where}: {len(sids)} haystack_session_ids but {len(sessions)} haystack_sessions")
    ids, texts, gold = [], [], []
    for sid, sess in zip(sids, sessions):
      st["sessions"] += 1
      for i, turn in enumerate(sess):
        w = f"{where}, session {sid!r} turn {i}"
        role = _field(turn, "role", w)
        content = _field(turn, "content", w)
        st["turns"] += 1
        if role != "user":
          continue
        tid = f"{sid}_{i + 1}"
        ids.append(tid)
        texts.append(str(content))
        texts_seen.add(str(content))
        if turn.get("has_answer"):
          gold.append(tid)
    if not ids:
      raise ValueError(f"{where}: empty memory bank (no user turns in its haystack)")
    st["user_turns"] += len(ids)
    banks.append(Bank(ids=ids, texts=texts, stores=np.zeros(len(ids), np.int8),
                      refs=[()] * len(ids)))
    st["questions"] += 1
    if qid.endswith("_abs"):
      st["questions_abs_excluded"] += 1
      continue
    if not gold:
      st["questions_without_gold_excluded"] += 1
      continue
    per_type[qtype] += 1
    queries.append(Query(id=qid, text=question, gold=tuple(dict.fromkeys(gold)), category=qtype,
                         group=g))
  stats = {
      "file": str(path),
      "questions": st["questions"],
      "queries_evaluable": len(queries),
      "questions_abs_excluded": st["questions_abs_excluded"],
      "questions_without_gold_excluded": st["questions_without_gold_excluded"],
      "sessions": st["sessions"],
      "turns": st["turns"],
      "user_turns": st["user_turns"],
      "user_turns_distinct_texts": len(texts_seen),
      "queries_per_category": dict(sorted(per_type.items())),
  }
  return Corpus(name="longmemeval", banks=banks, queries=queries, stats=stats)


def load_jsonl(path, *, limit: int | None = None) -> Corpus:
  """A user memory bank in the JSONL format of the module docstring. `limit`: first N queries."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"JSONL benchmark file {str(path)!r} does not exist")
  mems = collections.OrderedDict()  # bank -> list of (id, text, store, refs)
  raw_queries = []
  with open(path, encoding="utf-8") as f:
    for ln, line in enumerate(f, 1):
      line = line.strip()
      if not line or line.startswith("#"):
        continue
      where = f"{path}: line {ln}"
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON (truncated line?): {e}") from e
      kind = _field(obj, "type", where)
      bank = str(obj.get("bank", "default"))
      if kind == "memory":
        mid = str(_field(obj, "id", where))
        text = str(_field(obj, "text", where))
        store_name = str(obj.get("store", "dialogue"))
        if store_name not in _STORE_NAMES:
          raise ValueError(f"{where}: unknown store {store_name!r}; expected one of {sorted(_STORE_NAMES)}")
        refs = obj.get("refs", [])
        if not isinstance(refs, list):
          raise ValueError(f"{where}: field 'refs' must be a list of memory ids")
        mems.setdefault(bank, []).append((mid, text, _STORE_NAMES[store_name], tuple(map(str, refs)), ln))
      elif kind == "query":
        text = str(_field(obj, "text", where))
        gold = _field(obj, "gold", where)
        if not isinstance(gold, list):
          raise ValueError(f"{where}: field 'gold' must be a list of memory ids")
        raw_queries.append((str(obj.get("id", f"q{ln}")), text, tuple(map(str, gold)),
                            str(obj.get("category", "all")), bank, ln))
      else:
        raise ValueError(f"{where}: field 'type' must be 'memory' or 'query', got {kind!r}")
  if not mems:
    raise ValueError(f"{path}: empty memory bank (no memory lines)")
  banks, group_of = [], {}
  for name, items in mems.items():
    seen = set()
    for mid, *_, ln in items:
      if mid in seen:
        raise ValueError(f"{path}: line {ln}: duplicate memory id {mid!r} in bank {name!r}")
      seen.add(mid)
    group_of[name] = len(banks)
    banks.append(Bank(ids=[m[0] for m in items], texts=[m[1] for m in items],
                      stores=np.asarray([m[2] for m in items], np.int8),
                      refs=[m[3] for m in items]))
  if limit is not None:
    raw_queries = raw_queries[:limit]
  st = collections.Counter()
  queries, per_cat = [], collections.Counter()
  for qid, text, gold, cat, bank, ln in raw_queries:
    st["queries"] += 1
    if bank not in group_of:
      raise ValueError(f"{path}: line {ln}: query {qid!r} names bank {bank!r}, which has no memories")
    if not gold:
      st["queries_empty_evidence_dropped"] += 1
      continue
    b = banks[group_of[bank]]
    known = set(b.ids)
    good = tuple(x for x in gold if x in known)
    st["evidence_ids_dropped"] += len(gold) - len(good)
    if not good:
      st["queries_without_gold_excluded"] += 1
      continue
    per_cat[cat] += 1
    queries.append(Query(id=qid, text=text, gold=good, category=cat, group=group_of[bank]))
  stats = {
      "file": str(path),
      "banks": len(banks),
      "memories": sum(len(b) for b in banks),
      "observations": int(sum((b.stores == STORE_OBSERVATION).sum() for b in banks)),
      "queries": st["queries"],
      "queries_evaluable": len(queries),
      "queries_empty_evidence_dropped": st["queries_empty_evidence_dropped"],
      "queries_without_gold_excluded": st["queries_without_gold_excluded"],
      "evidence_ids_dropped": st["evidence_ids_dropped"],
      "queries_per_category": dict(sorted(per_cat.items())),
  }
  return Corpus(name="jsonl", banks=banks, queries=queries, stats=stats)


def load_corpus(name: str, *, data_dir=None, limit: int | None = None) -> Corpus:
  """`name` in 'locomo' | 'longmemeval' (found in the data dir) or a path to a .jsonl / .json file."""
  if name == "locomo":
    return load_locomo(find_benchmark_file("locomo", data_dir), limit=limit)
  if name == "longmemeval":
    return load_longmemeval(find_benchmark_file("longmemeval", data_dir), limit=limit)
  path = pathlib.Path(name)
  if path.suffix == ".jsonl" or name.startswith("jsonl:"):
    return load_jsonl(name[len("jsonl:"):] if name.startswith("jsonl:") else path, limit=limit)
  if path.name.startswith("locomo") and path.suffix == ".json":
    return load_locomo(path, limit=limit)
  if path.name.startswith("longmemeval") and path.is_file():
    return load_longmemeval(path, limit=limit)
  raise ValueError(f"unknown benchmark {name!r}: expected 'locomo', 'longmemeval', 'synthetic' "
                   "or a path to a .jsonl file")


def split_indices(num_queries: int, seed: int, train_fraction: float = 0.8
                  ) -> tuple[np.ndarray, np.ndarray]:
  """The 80/20 query split of Section 4.4.

  Args:
    num_queries: N.
    seed: the run's seed; `np.random.default_rng(seed).permutation(N)`.
    train_fraction: share of the online training stream; `floor(train_fraction * N)` queries.

  Returns:
    (`train_idx`, `test_idx`), int64 index arrays; training order is the stream order.
  """
  if not 0.0 <= train_fraction <= 1.0:
    raise ValueError(f"train_fraction must be in [0, 1], got {train_fraction}")
  perm = np.random.default_rng(seed).permutation(num_queries)
  n_train = int(np.floor(train_fraction * num_queries + 1e-9))
  return perm[:n_train].astype(np.int64), perm[n_train:].astype(np.int64)
