"""The loaded-benchmark data model: memory banks, queries, a `Corpus`, and a corpus with embeddings.

Symbols: `M` memories in a bank, `N` queries, `d` embedding dimension.

A loader returns a `Corpus`: one `Bank` per conversation / question / named bank and the evaluable
`Query`s in file order (`group` = their bank). Stores: 0 = dialogue turns (episodic), 1 =
observations (semantic, Section 5); an observation is gold when it, or a dialogue id it references
(`Bank.refs`), is gold (`gold_mask`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

STORE_DIALOGUE = 0
STORE_OBSERVATION = 1
# Store names accepted in user files, and the store each means.
STORE_NAMES = {"dialogue": STORE_DIALOGUE, "episodic": STORE_DIALOGUE,
               "observation": STORE_OBSERVATION, "semantic": STORE_OBSERVATION}


@dataclasses.dataclass
class Bank:
  """The memory bank of one conversation / question. `M` memories."""
  ids: list[str]  # [M] memory ids (unique in LoCoMo/JSONL; LongMemEval may repeat a session)
  texts: list[str]  # [M]
  stores: np.ndarray  # [M] int8, 0 = dialogue, 1 = observation
  refs: list[tuple[str, ...]]  # [M] dialogue ids an observation references; () for dialogue turns
  dates: list[str] | None = None  # [M] the session date of each memory ('' when unknown)

  def __len__(self):
    return len(self.ids)


@dataclasses.dataclass
class Query:
  """One evaluable query: its text, gold memory ids and the bank it searches."""
  id: str
  text: str
  gold: tuple[str, ...]  # gold memory ids (LoCoMo: normalised, resolvable dia_ids)
  category: str
  group: int  # index of its bank in `Corpus.banks`
  answer: str | None = None  # the gold answer (LoCoMo: str(answer); numbers become strings)
  date: str | None = None  # when the question is asked (LongMemEval `question_date`)


@dataclasses.dataclass
class Corpus:
  """A loaded benchmark: banks, evaluable queries (file order) and statistics."""
  name: str
  banks: list[Bank]
  queries: list[Query]
  stats: dict[str, Any]


@dataclasses.dataclass
class EmbeddedCorpus:
  """A corpus with embeddings: `bank_embeddings[g]` `[M_g, d]`, `query_embeddings` `[N, d]`."""
  corpus: Corpus
  bank_embeddings: list[np.ndarray]
  query_embeddings: np.ndarray


def gold_mask(bank: Bank, gold: Sequence[str]) -> np.ndarray:
  """`[M]` bool: memory is gold when its id is gold or it references a gold dialogue id."""
  gold = set(gold)
  return np.array([i in gold or any(r in gold for r in refs)
                   for i, refs in zip(bank.ids, bank.refs)], bool)
