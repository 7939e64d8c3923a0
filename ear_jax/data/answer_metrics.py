"""The benchmarks' own answer scores: LoCoMo's F1, BLEU-1, and the abstention rules.

Pure text functions (no I/O, no JAX, no LLM); the LLM judge lives in `ear_jax.agent.llm.qa`.

LoCoMo F1 follows `eval_question_answering` of snap-research/LoCoMo `task_eval/evaluation.py`:
`normalize_answer`, the Porter-stemmed multiset `token_f1`, and the per-category rules of
`locomo_f1` (3: gold before the first ';'; 1: `multi_answer_f1` over ','-split parts; 5: an
abstention phrase). LongMemEval uses the same `token_f1`; its `_abs` questions (`is_abstention`)
are judged with the official abstention prompt. BLEU-1 (`bleu1`) is mem0's / A-Mem's NLTK
`sentence_bleu` with unigram weights and `method1` smoothing, i.e. BP * p1, over `tokenize`, a
regular expression approximating `nltk.word_tokenize`.
"""
from __future__ import annotations

import collections
import functools
import math
import re
import string
from typing import Sequence

# The loader's category names (`ear_jax.data.locomo.CATEGORIES`) -> LoCoMo's category numbers.
LOCOMO_CATEGORY_NUMBERS = {"multi-hop": 1, "temporal": 2, "open-domain": 3, "single-hop": 4,
                           "adversarial": 5}
ADVERSARIAL_PHRASES = ("no information available", "not mentioned")
_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the|and)\b")
# Treebank-like tokens: clitics apart, hyphenated words and decimals whole, quotes as `` / ''.
_TOKEN = re.compile(r"\w+(?=n't\b)|n't\b|'(?:s|m|d|ll|re|ve)\b|\w+(?:[-.]\w+)*|``|''|\S")
_OPEN_QUOTE = re.compile(r'(^|(?<=[\s(\[{<]))"')


def normalize_answer(text: str) -> str:
  """LoCoMo's `normalize_answer`: no commas, lower case, no punctuation, no a/an/the/and."""
  text = str(text).replace(",", "").lower()
  text = "".join(ch for ch in text if ch not in _PUNCT)
  return " ".join(_ARTICLES.sub(" ", text).split())


@functools.cache
def _stemmer():
  from nltk.stem.porter import PorterStemmer  # pylint: disable=g-import-not-at-top
  return PorterStemmer()  # (imported on first use: nltk takes half a second to import)


@functools.lru_cache(maxsize=1 << 16)
def stem(word: str) -> str:
  """The Porter stem of `word` (lower-cased) by NLTK's stemmer, as LoCoMo's scorer stems."""
  return _stemmer().stem(word)


def stemmed_tokens(text: str) -> list[str]:
  """Porter stems of the normalised text's white-space tokens."""
  return [stem(w) for w in normalize_answer(text).split()]


def token_f1(prediction: str, gold: str) -> float:
  """LoCoMo's `f1_score`: F1 of the stemmed token multisets (0 when nothing overlaps)."""
  pred, ref = stemmed_tokens(prediction), stemmed_tokens(gold)
  same = sum((collections.Counter(pred) & collections.Counter(ref)).values())
  if same == 0:
    return 0.0
  precision, recall = same / len(pred), same / len(ref)
  return 2 * precision * recall / (precision + recall)


def multi_answer_f1(prediction: str, gold: str) -> float:
  """LoCoMo's `f1` (multi-hop): mean over ','-separated gold parts of the best part-wise F1."""
  preds = [p.strip() for p in str(prediction).split(",")]
  golds = [g.strip() for g in str(gold).split(",")]
  return sum(max(token_f1(p, g) for p in preds) for g in golds) / len(golds)


def adversarial_score(prediction: str) -> float:
  """LoCoMo category 5: 1 when the answer says 'no information available' / 'not mentioned'."""
  return 1.0 if any(p in str(prediction).lower() for p in ADVERSARIAL_PHRASES) else 0.0


def locomo_category_number(category) -> int:
  """LoCoMo's category number from a number or the loader's name (ValueError if not one of five)."""
  if isinstance(category, str) and category in LOCOMO_CATEGORY_NUMBERS:
    return LOCOMO_CATEGORY_NUMBERS[category]
  if isinstance(category, int) and not isinstance(category, bool) and 1 <= category <= 5:
    return category
  raise ValueError(f"unknown LoCoMo category {category!r}; expected 1-5 or one of "
                   f"{sorted(LOCOMO_CATEGORY_NUMBERS)}")


def locomo_f1(prediction: str, gold, category) -> float:
  """LoCoMo's per-question score (F1 in [0, 1]) with the official per-category rules."""
  cat = locomo_category_number(category)
  if cat == 5:
    return adversarial_score(prediction)
  gold = str(gold)
  if cat == 3:
    gold = gold.split(";")[0].strip()
  if cat == 1:
    return multi_answer_f1(prediction, gold)
  return token_f1(prediction, gold)


def answer_f1(benchmark: str, prediction: str, gold, category) -> float:
  """F1 in [0, 1]: LoCoMo's official rules for 'locomo', `token_f1` otherwise."""
  if benchmark == "locomo":
    return locomo_f1(prediction, gold, category)
  return token_f1(prediction, str(gold))


def tokenize(text: str) -> list[str]:
  """Lower-cased word-character runs and single punctuation marks (BLEU-1 tokens)."""
  text = _OPEN_QUOTE.sub("``", str(text).lower()).replace('"', "''")
  return _TOKEN.findall(text)


def bleu1(prediction: str, gold) -> float:
  """Sentence BLEU-1 in [0, 1] of `prediction` against the single reference `gold` (see module)."""
  hyp, ref = tokenize(prediction), tokenize(str(gold))
  if not hyp or not ref:
    return 0.0
  ref_counts = collections.Counter(ref)
  matched = sum(min(n, ref_counts[t]) for t, n in collections.Counter(hyp).items())
  if matched == 0:
    return 0.0
  c, r = len(hyp), len(ref)
  bp = 1.0 if c > r else math.exp(1 - r / c)
  return bp * matched / c


def is_abstention(question_id: str) -> bool:
  """LongMemEval: an abstention (unanswerable) question (`_abs` in the id)."""
  return "_abs" in str(question_id)


def mean_percent(values: Sequence[float]) -> float:
  """100 x the mean (NaN for no values)."""
  return 100.0 * sum(values) / len(values) if len(values) else float("nan")
