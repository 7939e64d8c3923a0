"""The Porter stemmer exactly as NLTK's `PorterStemmer()` (default mode `NLTK_EXTENSIONS`).

LoCoMo's official answer scorer stems with it; this is a port of `nltk/stem/porter.py` (NLTK 3.10,
Apache License 2.0, authors Vivake Gupta, Barry Wilkins, Edward Loper, Mark Amery) without the
`nltk` dependency. `tests/test_answer_metrics.py` checks it against NLTK where importable.
"""
from __future__ import annotations

import functools

_VOWELS = frozenset("aeiou")
_IRREGULAR = {"sky": ["sky", "skies"], "die": ["dying"], "lie": ["lying"], "tie": ["tying"],
              "news": ["news"], "inning": ["innings", "inning"], "outing": ["outings", "outing"],
              "canning": ["cannings", "canning"], "howe": ["howe"], "proceed": ["proceed"],
              "exceed": ["exceed"], "succeed": ["succeed"]}
_POOL = {form: stem for stem, forms in _IRREGULAR.items() for form in forms}


def _flags(word: str) -> list[bool]:
  """`True` where `word[i]` is a consonant ('y' is one unless it follows a consonant)."""
  flags = []
  for i, ch in enumerate(word):
    if ch in _VOWELS:
      flags.append(False)
    elif ch == "y":
      flags.append(True if i == 0 else not flags[i - 1])
    else:
      flags.append(True)
  return flags


def _cons(word: str, i: int) -> bool:
  return _flags(word[:i + 1])[i]


def _measure(stem: str) -> int:
  """Porter's m: the number of VC sequences in `[C](VC){m}[V]`."""
  return "".join("c" if c else "v" for c in _flags(stem)).count("vc")


def _positive(stem: str) -> bool:
  return _measure(stem) > 0


def _has_vowel(stem: str) -> bool:
  return not all(_flags(stem))


def _double_consonant(word: str) -> bool:
  return len(word) >= 2 and word[-1] == word[-2] and _cons(word, len(word) - 1)


def _cvc(word: str) -> bool:
  """*o: the stem ends consonant-vowel-consonant, the last not w, x or y (NLTK: or is 'vc')."""
  if len(word) >= 3:
    f = _flags(word)
    if f[-3] and not f[-2] and f[-1] and word[-1] not in "wxy":
      return True
  return len(word) == 2 and not _cons(word, 0) and _cons(word, 1)


def _apply(word: str, rules) -> str:
  """The first rule whose suffix matches decides (`(suffix, replacement, condition)`)."""
  for suffix, replacement, condition in rules:
    if suffix == "*d" and _double_consonant(word):
      stem = word[:-2]
      return stem + replacement if condition is None or condition(stem) else word
    if word.endswith(suffix):
      stem = word[:len(word) - len(suffix)] if suffix else word
      return stem + replacement if condition is None or condition(stem) else word
  return word


def _step1a(word: str) -> str:
  if word.endswith("ies") and len(word) == 4:
    return word[:-3] + "ie"
  return _apply(word, [("sses", "ss", None), ("ies", "i", None), ("ss", "ss", None),
                       ("s", "", None)])


def _step1b(word: str) -> str:
  if word.endswith("ied"):
    return word[:-3] + ("ie" if len(word) == 4 else "i")
  if word.endswith("eed"):
    stem = word[:-3]
    return stem + "ee" if _measure(stem) > 0 else word
  for suffix in ("ed", "ing"):
    if word.endswith(suffix) and _has_vowel(word[:-len(suffix)]):
      stem = word[:-len(suffix)]
      break
  else:
    return word
  return _apply(stem, [("at", "ate", None), ("bl", "ble", None), ("iz", "ize", None),
                       ("*d", stem[-1], lambda s: stem[-1] not in "lsz"),
                       ("", "e", lambda s: _measure(s) == 1 and _cvc(s))])


def _step1c(word: str) -> str:
  return _apply(word, [("y", "i", lambda s: len(s) > 1 and _cons(s, len(s) - 1))])


_STEP2 = [("ational", "ate"), ("tional", "tion"), ("enci", "ence"), ("anci", "ance"),
          ("izer", "ize"), ("bli", "ble"), ("alli", "al"), ("entli", "ent"), ("eli", "e"),
          ("ousli", "ous"), ("ization", "ize"), ("ation", "ate"), ("ator", "ate"),
          ("alism", "al"), ("iveness", "ive"), ("fulness", "ful"), ("ousness", "ous"),
          ("aliti", "al"), ("iviti", "ive"), ("biliti", "ble"), ("fulli", "ful")]


def _step2(word: str) -> str:
  if word.endswith("alli") and _positive(word[:-4]):
    return _step2(word[:-4] + "al")
  rules = [(s, r, _positive) for s, r in _STEP2]
  rules.append(("logi", "log", lambda s: _positive(word[:-3])))
  return _apply(word, rules)


def _step3(word: str) -> str:
  return _apply(word, [(s, r, _positive) for s, r in (
      ("icate", "ic"), ("ative", ""), ("alize", "al"), ("iciti", "ic"), ("ical", "ic"),
      ("ful", ""), ("ness", ""))])


def _step4(word: str) -> str:
  gt1 = lambda s: _measure(s) > 1  # pylint: disable=unnecessary-lambda-assignment
  rules = [(s, "", gt1) for s in ("al", "ance", "ence", "er", "ic", "able", "ible", "ant",
                                   "ement", "ment", "ent")]
  rules.append(("ion", "", lambda s: _measure(s) > 1 and s[-1:] in ("s", "t")))
  rules += [(s, "", gt1) for s in ("ou", "ism", "ate", "iti", "ous", "ive", "ize")]
  return _apply(word, rules)


def _step5a(word: str) -> str:
  if word.endswith("e"):
    stem = word[:-1]
    m = _measure(stem)
    if m > 1 or (m == 1 and not _cvc(stem)):
      return stem
  return word


def _step5b(word: str) -> str:
  return _apply(word, [("ll", "l", lambda s: _measure(word[:-1]) > 1)])


@functools.lru_cache(maxsize=1 << 16)
def stem(word: str) -> str:
  """The Porter stem of `word` (lower-cased first), as `nltk.stem.PorterStemmer().stem(word)`."""
  s = word.lower()
  if s in _POOL:
    return _POOL[s]
  if len(word) <= 2:
    return s
  for step in (_step1a, _step1b, _step1c, _step2, _step3, _step4, _step5a, _step5b):
    s = step(s)
  return s
