"""LoCoMo's official answer F1 (normalisation, Porter stems, per-category rules), BLEU-1, and the
abstention rules, on hand-worked examples."""
import math

import pytest

from ear_jax.data import answer_metrics as am


@pytest.mark.parametrize("word, stem", [
    # Porter (1980)'s own examples, steps 1a-5b.
    ("caresses", "caress"), ("ponies", "poni"), ("cats", "cat"), ("feed", "feed"),
    ("agreed", "agre"),  # 1b: agreed -> agree; 5a: m("agre") = 1, not *o -> agre
    ("hopping", "hop"), ("sing", "sing"), ("happy", "happi"), ("relational", "relat"),
    ("conditional", "condit"), ("adoption", "adopt"), ("controlling", "control"),
    ("hopefulness", "hope"), ("probate", "probat"), ("rate", "rate"), ("cease", "ceas"),
    # NLTK's extensions (its default mode, what LoCoMo's scorer uses).
    ("ties", "tie"),  # 4-letter 'ies' -> 'ie'
    ("dying", "die"), ("skies", "sky"),  # irregular forms
    ("enjoy", "enjoy"),  # y -> i only after a consonant
    ("fully", "fulli"), ("generously", "gener"), ("analogous", "analog"),
    ("is", "is"), ("was", "wa"), ("Running", "run"),  # short words untouched; lower-cased
    ("agencies", "agenc"), ("agency", "agenc"),
])
def test_porter_stems_as_locomo_s_scorer(word, stem):
  assert am.stem(word) == stem


@pytest.mark.parametrize("text, norm", [
    ("The Cat, and a Dog!", "cat dog"),
    ("  7 May, 2023. ", "7 may 2023"),
    ("An apple-a-day", "appleaday"),  # punctuation is deleted, not a separator
    ("Sandy's theatre", "sandys theatre"),
])
def test_normalize_answer(text, norm):
  assert am.normalize_answer(text) == norm


def test_token_f1_hand_worked():
  # pred tokens [she, went, to, park, yesterday] vs gold [park]: P = 1/5, R = 1 -> F1 = 1/3.
  assert am.token_f1("She went to the park yesterday.", "the park") == pytest.approx(1 / 3)
  # stems make singular and plural agree: adopt agenc == adopt agenc
  assert am.token_f1("Adoption agencies", "adoption agency") == 1.0
  assert am.token_f1("Paris", "London") == 0.0
  assert am.token_f1("", "London") == 0.0
  # multiset overlap: "run run" vs "run": P = 1/2, R = 1 -> 2/3
  assert am.token_f1("running runs", "run") == pytest.approx(2 / 3)


def test_multi_hop_partial_f1_splits_on_commas():
  # gold parts: London -> best 1.0 (vs "London"); Berlin -> 0 -> mean 0.5
  assert am.locomo_f1("Paris, London", "London, Berlin", "multi-hop") == pytest.approx(0.5)
  assert am.locomo_f1("Paris, London", "London, Berlin", 1) == pytest.approx(0.5)
  # without the split the same pair scores the plain token F1 (P = R = 1/2)
  assert am.locomo_f1("Paris, London", "London, Berlin", "single-hop") == pytest.approx(0.5)
  assert am.locomo_f1("London", "London, Berlin", "multi-hop") == pytest.approx(0.5)
  assert am.locomo_f1("London and Berlin", "London, Berlin", "multi-hop") == pytest.approx(
      (2 * 0.5 * 1 / 1.5 + 2 * 0.5 * 1 / 1.5) / 2)


def test_open_domain_gold_keeps_the_part_before_the_first_semicolon():
  assert am.locomo_f1("Likely no", "Likely no; she was supported", "open-domain") == 1.0
  assert am.locomo_f1("Likely no", "Likely no; she was supported", "single-hop") < 1.0


def test_adversarial_rule_and_numeric_gold():
  assert am.locomo_f1("Not mentioned in the conversation", "ignored", 5) == 1.0
  assert am.locomo_f1("No information AVAILABLE.", "ignored", "adversarial") == 1.0
  assert am.locomo_f1("Yes, she did", "Not mentioned", 5) == 0.0
  assert am.locomo_f1("In 2022", 2022, "temporal") == pytest.approx(2 / 3)
  with pytest.raises(ValueError, match="unknown LoCoMo category 'knowledge'"):
    am.locomo_f1("x", "y", "knowledge")


def test_answer_f1_uses_plain_token_f1_outside_locomo():
  assert am.answer_f1("longmemeval", "Paris, London", "London, Berlin", "multi-session") == \
      pytest.approx(0.5)
  assert am.answer_f1("longmemeval", "Not mentioned", "3 days", "temporal-reasoning") == 0.0


def test_bleu1_hand_worked():
  assert am.bleu1("the cat sat", "the cat") == pytest.approx(2 / 3)  # c > r: BP = 1
  assert am.bleu1("cat", "the cat sat on") == pytest.approx(math.exp(1 - 4))  # p1 = 1, BP = e^-3
  assert am.bleu1("the the the", "the cat") == pytest.approx(1 / 3)  # clipped counts
  assert am.bleu1("The Cat", "the cat") == 1.0  # lower-cased, c = r: BP = 1
  assert am.bleu1("dog", "the cat") == 0.0
  assert am.bleu1("", "the cat") == 0.0
  # punctuation is a token: "paris ." vs "paris": p1 = 1/2, c > r
  assert am.bleu1("Paris.", "Paris") == pytest.approx(0.5)


def test_tokenize_is_treebank_like():
  assert am.tokenize("She's in the U.S. don't") == ["she", "'s", "in", "the", "u.s", ".", "do",
                                                    "n't"]
  assert am.tokenize('"Becoming Nicole" self-care') == ["``", "becoming", "nicole", "''",
                                                        "self-care"]


def test_abstention_questions_are_named_by_their_id():
  assert am.is_abstention("0862e8bf_abs")
  assert not am.is_abstention("0862e8bf")
