"""The LoCoMo loader (`locomo10.json`): one memory bank per conversation, QA items as queries.

Bank = the conversation's dialogue turns (`"<speaker>: <text>"`, plus the image caption; id =
`dia_id`), dated with their session's date; observations are store 1 with ids `"O<N>:<j>"`.
Queries carry their gold `answer`. Categories 1-4 are kept, 5 (adversarial) is dropped. Evidence
ids are normalised (`normalize_evidence`); ids naming no turn are dropped and counted, and queries
left without gold are excluded and counted (an ABSENT `evidence` field is an error). A field of
the wrong type is a `ValueError` naming the file, the conversation and the field.
"""
from __future__ import annotations

import collections
import pathlib
import re

import numpy as np

from ear_jax.data import corpus as corpus_lib
from ear_jax.data import parsing
from ear_jax.data import sources

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
ADVERSARIAL = 5
FILES = ("locomo10.json",)  # looked up in the data directory
_EVIDENCE_RE = re.compile(r"^D:?(\d+):0*(\d+)$")
_SESSION_RE = re.compile(r"^session_(\d+)$")
_DATE_RE = re.compile(r"^session_(\d+)_date_time$")


def normalize_evidence(raw) -> tuple[list[str], list[str]]:
  """Normalises LoCoMo evidence / observation references to `"D<session>:<turn>"` ids.

  A string or list of strings, ids joined by `;`, `,` or spaces; `D:?(\\d+):0*(\\d+)` becomes
  `D<s>:<t>` ("D:11:26" -> "D11:26", "D30:05" -> "D30:5"); other tokens are malformed.

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


def _evidence_value(value, where, key):
  """`value` if it is a string or a list of strings (LoCoMo `evidence`, an observation's dia_id)."""
  parsing.check(value, parsing.STRING_OR_LIST, where, key)
  if isinstance(value, list):
    for i, item in enumerate(value):
      if not isinstance(item, str):
        raise ValueError(f"{where}: field {key!r} must be a string or a list of strings, but entry "
                         f"{i} is {parsing.json_type(item)}")
  return value


def _session_dates(conv_dict, where) -> dict[str, str]:
  """Session number (as a string) -> its `session_<N>_date_time` ('' when absent)."""
  dates = {}
  for k, v in conv_dict.items():
    m = _DATE_RE.match(k)
    if m:
      dates[str(int(m.group(1)))] = parsing.check(v, parsing.STRING, where, f"conversation.{k}")
  return dates


def _dialogue_turns(conv_dict, where, st):
  """(ids, texts, session numbers) of a `conversation` object's turns, sessions in number order."""
  sessions = sorted((int(m.group(1)), k) for k in conv_dict if (m := _SESSION_RE.match(k)))
  ids, texts, nums = [], [], []
  for num, key in sessions:
    turns = parsing.check(conv_dict[key], parsing.LIST, where, f"conversation.{key}")
    st["sessions"] += 1
    for j, turn in enumerate(turns):
      w = f"{where}, {key} turn {j}"
      dia_id = parsing.name(turn, "dia_id", w)
      speaker = parsing.require(turn, "speaker", w, parsing.STRING)
      text = parsing.require(turn, "text", w, parsing.STRING)
      t = f"{speaker}: {text}"
      caption = parsing.optional(turn, "blip_caption", w, parsing.STRING_OR_NULL, None)
      if caption:
        t += f" [image: {caption}]"
      ids.append(dia_id)
      texts.append(t)
      nums.append(str(num))
  return ids, texts, nums


def _observations(obs, where, turn_ids, st):
  """(ids, texts, refs, session numbers) of the observation store of one conversation."""
  ids, texts, refs, nums = [], [], [], []

  def session(k):  # the first number in a key ('' when none)
    return (re.findall(r"\d+", k) or [""])[0]

  for okey in sorted(obs, key=lambda k: int(session(k) or 0)):
    n_sess = session(okey) or okey
    per_speaker = obs[okey]
    if per_speaker is None:
      continue
    parsing.check(per_speaker, parsing.OBJECT, where, f"observation.{okey}")
    j = 0
    for speaker, facts in per_speaker.items():
      field = f"observation.{okey}.{speaker}"
      parsing.check(facts, parsing.LIST, where, field)
      for e, fact in enumerate(facts):
        if not isinstance(fact, (list, tuple)) or len(fact) < 2:
          raise ValueError(f"{where}: observation {okey}/{speaker} entry {fact!r} is not [fact, dia_id]")
        w = f"{where}, {field} entry {e}"
        parsing.check(fact[0], parsing.STRING, w, "fact")
        r, bad = normalize_evidence(_evidence_value(fact[1], w, "dia_id"))
        good = tuple(x for x in r if x in turn_ids)
        st["observation_refs_unresolvable"] += len(r) - len(good) + len(bad)
        ids.append(f"O{n_sess}:{j}")
        texts.append(fact[0])
        refs.append(good)
        nums.append(str(int(n_sess)) if n_sess.isdigit() else n_sess)
        j += 1
        st["observations"] += 1
  return ids, texts, refs, nums


def load_locomo(path, *, limit: int | None = None) -> corpus_lib.Corpus:
  """LoCoMo (see module docstring). `limit`: only the first `limit` conversations.

  Raises:
    FileNotFoundError: no such file.
    ValueError: naming the file, the conversation and the field, for malformed input.
  """
  path = pathlib.Path(path)
  data = parsing.read_json_list(path, "conversations", limit)
  banks, queries = [], []
  st, per_cat = collections.Counter(), collections.Counter()
  dropped_ids = []
  for g, conv in enumerate(data):
    parsing.check_object(conv, f"{path}: conversation {g}")
    sample_id = parsing.name(conv, "sample_id", f"{path}: conversation {g}", default=str(g))
    where = f"{path}: conversation {sample_id!r}"
    c = parsing.require(conv, "conversation", where, parsing.OBJECT)
    qa = parsing.require(conv, "qa", where, parsing.LIST)
    ids, texts, nums = _dialogue_turns(c, where, st)
    session_dates = _session_dates(c, where)
    if not ids:
      raise ValueError(f"{where}: empty memory bank (no dialogue turns)")
    st["turns"] += len(ids)
    stores = [corpus_lib.STORE_DIALOGUE] * len(ids)
    refs = [()] * len(ids)
    turn_ids = set(ids)
    obs = conv.get("observation")
    if obs is not None:
      parsing.check(obs, parsing.Kind((dict,), "a JSON object (session_N_observation -> speaker -> "
                                               "[[fact, dia_id], ...])"), where, "observation")
      o_ids, o_texts, o_refs, o_nums = _observations(obs, where, turn_ids, st)
      ids += o_ids
      texts += o_texts
      refs += o_refs
      nums += o_nums
      stores += [corpus_lib.STORE_OBSERVATION] * len(o_ids)
    banks.append(corpus_lib.Bank(ids=ids, texts=texts, stores=np.asarray(stores, np.int8),
                                 refs=refs, dates=[session_dates.get(n, "") for n in nums]))
    for qi, item in enumerate(qa):
      w = f"{where}, qa item {qi}"
      cat = parsing.require(item, "category", w)
      if cat == ADVERSARIAL and not isinstance(cat, bool):
        st["queries_adversarial_dropped"] += 1
        continue
      if isinstance(cat, bool) or cat not in CATEGORIES:
        raise ValueError(f"{w}: unknown category {cat!r}")
      question = parsing.require(item, "question", w, parsing.STRING)
      answer = parsing.optional(item, "answer", w, parsing.ANSWER, None)
      if answer is None:
        st["queries_without_answer"] += 1
      evidence = _evidence_value(parsing.require(item, "evidence", w), w, "evidence")
      st["queries"] += 1
      if not evidence:
        st["queries_empty_evidence_dropped"] += 1
        continue
      norm, bad = normalize_evidence(evidence)
      for e in (evidence if isinstance(evidence, list) else [evidence]):
        if normalize_evidence(e) != ([str(e)], []):  # not already one canonical "D<s>:<t>"
          st["evidence_entries_malformed"] += 1
      gold = tuple(x for x in norm if x in turn_ids)
      dropped = [x for x in norm if x not in turn_ids] + bad
      if dropped:
        st["evidence_ids_dropped"] += len(dropped)
        dropped_ids.extend(f"{sample_id}/{x}" for x in dropped)
      if not gold:
        st["queries_without_gold_excluded"] += 1
        continue
      category = CATEGORIES[cat]
      per_cat[category] += 1
      queries.append(corpus_lib.Query(id=f"{sample_id}/q{qi}", text=question, gold=gold,
                                      category=category, group=g,
                                      answer=None if answer is None else str(answer)))
  counted = ("queries_adversarial_dropped", "queries_empty_evidence_dropped",
             "queries_without_gold_excluded", "queries_without_answer",
             "evidence_entries_malformed", "evidence_ids_dropped")
  stats = {"file": sources.shown_path(path), "conversations": len(banks),
           **{k: st[k] for k in ("sessions", "turns", "observations", "queries")},
           "queries_evaluable": len(queries), **{k: st[k] for k in counted},
           "evidence_ids_dropped_list": dropped_ids,
           "observation_refs_unresolvable": st["observation_refs_unresolvable"],
           "queries_per_category": dict(sorted(per_cat.items()))}
  return corpus_lib.Corpus(name="locomo", banks=banks, queries=queries, stats=stats)
