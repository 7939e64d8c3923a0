"""The user JSONL benchmark format (full description: docs/jsonl_format.md).

One JSON object per line (UTF-8); blank lines and lines starting with `#` are skipped:

  {"type": "memory", "id": "m1", "text": "I adopted a cat named Luna.", "bank": "alice"}
  {"type": "query", "id": "q1", "text": "What is my cat called?", "gold": ["m1"], "bank": "alice"}

Strict on input: every error names the file, the line and the field; a file without memories or
without an evaluable query is an error. A query searches only its own bank.
"""
from __future__ import annotations

import collections
import json
import pathlib
import re

import numpy as np

from ear_jax.data import corpus as corpus_lib
from ear_jax.data import parsing

_LINE_BREAK = re.compile(rb"\r\n|\r|\n")  # as Python's text mode; never inside a UTF-8 sequence


def _lines(path: pathlib.Path):
  """Yields (line number, stripped text) of the non-blank, non-comment lines of a UTF-8 file."""
  if path.is_dir():
    raise IsADirectoryError(f"JSONL benchmark path {str(path)!r} is a directory, not a .jsonl file")
  if not path.is_file():
    raise FileNotFoundError(f"JSONL benchmark file {str(path)!r} does not exist")
  for ln, raw in enumerate(_LINE_BREAK.split(path.read_bytes()), 1):
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(f"{path}: line {ln}: not valid UTF-8 (byte {e.start + 1} of the line: "
                       f"{raw[e.start:e.start + 4]!r}); save the file as UTF-8") from None
    if ln == 1:
      line = line.removeprefix("\ufeff")  # a UTF-8 byte-order mark
    line = line.strip()
    if line and not line.startswith("#"):
      yield ln, line


def _parse(path: pathlib.Path):
  """(memories by bank, raw queries) of the file, each field checked."""
  mems = collections.OrderedDict()  # bank -> list of (id, text, store, refs, line)
  raw_queries = []  # (id, text, gold, category, bank, line)
  for ln, line in _lines(path):
    where = f"{path}: line {ln}"
    try:
      obj = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as e:
      raise ValueError(f"{where}: invalid JSON (truncated line?): {e}") from None
    kind = parsing.require(obj, "type", where)
    bank = parsing.name(obj, "bank", where, default="default")
    if kind == "memory":
      mid = parsing.name(obj, "id", where)
      text = parsing.nonempty_text(obj, "text", where)
      store_name = parsing.optional(obj, "store", where, parsing.STRING, "dialogue")
      if store_name not in corpus_lib.STORE_NAMES:
        raise ValueError(f"{where}: unknown store {store_name!r}; expected one of "
                         f"{sorted(corpus_lib.STORE_NAMES)}")
      refs = parsing.name_list(obj, "refs", where, default=[])
      mems.setdefault(bank, []).append((mid, text, corpus_lib.STORE_NAMES[store_name], refs, ln))
    elif kind == "query":
      text = parsing.nonempty_text(obj, "text", where)
      gold = parsing.name_list(obj, "gold", where)
      qid = parsing.name(obj, "id", where, default=f"q{ln}")
      category = parsing.name(obj, "category", where, default="all")
      raw_queries.append((qid, text, gold, category, bank, ln))
    else:
      raise ValueError(f"{where}: field 'type' must be 'memory' or 'query', got {kind!r}")
  return mems, raw_queries


def load_jsonl(path, *, limit: int | None = None) -> corpus_lib.Corpus:
  """A user memory bank in the JSONL format. `limit`: first N queries.

  Raises:
    FileNotFoundError: no such file.
    IsADirectoryError: the path is a directory.
    ValueError: naming the file, the line and the field, for malformed input; also for a file
      without memories or without an evaluable query (before anything is encoded).
  """
  path = pathlib.Path(path)
  mems, raw_queries = _parse(path)
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
    banks.append(corpus_lib.Bank(ids=[m[0] for m in items], texts=[m[1] for m in items],
                                 stores=np.asarray([m[2] for m in items], np.int8),
                                 refs=[m[3] for m in items]))
  if not raw_queries:
    raise ValueError(f"{path}: no query lines: a benchmark needs queries "
                     '({"type": "query", "text": ..., "gold": [memory ids]}, see docs/jsonl_format.md)')
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
    known = set(banks[group_of[bank]].ids)
    good = tuple(x for x in gold if x in known)
    st["evidence_ids_dropped"] += len(gold) - len(good)
    if not good:
      st["queries_without_gold_excluded"] += 1
      continue
    per_cat[cat] += 1
    queries.append(corpus_lib.Query(id=qid, text=text, gold=good, category=cat,
                                    group=group_of[bank]))
  if not queries:
    raise ValueError(
        f"{path}: none of its {st['queries']} queries is evaluable "
        f"({st['queries_empty_evidence_dropped']} with an empty 'gold', "
        f"{st['queries_without_gold_excluded']} whose gold ids name no memory of their bank)")
  stats = {"file": str(path), "banks": len(banks), "memories": sum(len(b) for b in banks),
           "observations": int(sum((b.stores == corpus_lib.STORE_OBSERVATION).sum()
                                   for b in banks)),
           "queries": st["queries"], "queries_evaluable": len(queries),
           "queries_empty_evidence_dropped": st["queries_empty_evidence_dropped"],
           "queries_without_gold_excluded": st["queries_without_gold_excluded"],
           "evidence_ids_dropped": st["evidence_ids_dropped"],
           "queries_per_category": dict(sorted(per_cat.items()))}
  return corpus_lib.Corpus(name="jsonl", banks=banks, queries=queries, stats=stats)
