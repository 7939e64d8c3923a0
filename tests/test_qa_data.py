"""Gold answers and session dates loaded with the queries: LoCoMo and LongMemEval, with clear
errors for malformed answer / date fields."""
import copy
import json

import pytest

from ear_jax.data import corpora
from ear_jax.data import locomo
from ear_jax.data import longmemeval
from tests.conftest import FIXTURES


def _conv():
  return {
      "sample_id": "c1",
      "conversation": {
          "speaker_a": "Ann", "speaker_b": "Bob",
          "session_1_date_time": "1:56 pm on 8 May, 2023",
          "session_1": [{"speaker": "Ann", "dia_id": "D1:1", "text": "I went hiking yesterday."},
                        {"speaker": "Bob", "dia_id": "D1:2", "text": "Nice!"}],
          "session_2_date_time": "7:55 pm on 25 May, 2023",
          "session_2": [{"speaker": "Bob", "dia_id": "D2:1", "text": "I bought 3 cats."}],
          "session_3": [{"speaker": "Ann", "dia_id": "D3:1", "text": "No date here."}],
      },
      "observation": {"session_2_observation": {"Bob": [["Bob has cats.", "D2:1"]]}},
      "qa": [
          {"question": "When did Ann hike?", "answer": "7 May 2023", "evidence": ["D1:1"],
           "category": 2},
          {"question": "How many cats?", "answer": 3, "evidence": ["D2:1"], "category": 4},
          {"question": "Is Bob a pilot?", "adversarial_answer": "yes", "evidence": ["D1:2"],
           "category": 5},
          {"question": "What did Ann say?", "evidence": ["D3:1"], "category": 1},
      ],
  }


def _write(tmp_path, data, name="locomo10.json"):
  p = tmp_path / name
  p.write_text(json.dumps(data))
  return p


def test_locomo_answers_and_session_dates(tmp_path):
  c = locomo.load_locomo(_write(tmp_path, [_conv()]))
  assert [q.answer for q in c.queries] == ["7 May 2023", "3", None]  # numbers become strings
  assert c.stats["queries_without_answer"] == 1 and c.stats["queries_adversarial_dropped"] == 1
  bank = c.banks[0]
  dates = dict(zip(bank.ids, bank.dates))
  assert dates["D1:1"] == dates["D1:2"] == "1:56 pm on 8 May, 2023"
  assert dates["D2:1"] == "7:55 pm on 25 May, 2023"
  assert dates["D3:1"] == ""  # the session has no date
  assert dates["O2:0"] == "7:55 pm on 25 May, 2023"  # an observation takes its session's date
  assert len(bank.dates) == len(bank.ids)


def test_real_locomo_has_an_answer_and_a_date_for_every_query_and_memory(locomo_path):
  c = corpora.load_corpus("locomo", data_dir=locomo_path.parent)
  assert c.stats["queries_without_answer"] == 0
  assert all(q.answer for q in c.queries)
  assert all(all(b.dates) and len(b.dates) == len(b.ids) for b in c.banks)
  assert c.queries[0].answer == "7 May 2023"


@pytest.mark.parametrize("field, value, match", [
    ("answer", ["a"], "qa item 0: field 'answer' must be a string or a number, got list"),
    ("answer", None, "qa item 0: field 'answer' must be a string or a number, got null"),
    ("answer", True, "field 'answer' must be a string or a number, got boolean"),
])
def test_locomo_malformed_answer_names_file_item_and_field(tmp_path, field, value, match):
  conv = _conv()
  conv["qa"][0][field] = value
  p = _write(tmp_path, [conv])
  with pytest.raises(ValueError, match=match) as e:
    locomo.load_locomo(p)
  assert str(p) in str(e.value) and "'c1'" in str(e.value)


def test_locomo_non_string_session_date_is_an_error(tmp_path):
  conv = _conv()
  conv["conversation"]["session_2_date_time"] = 20230525
  with pytest.raises(ValueError, match="field 'conversation.session_2_date_time' must be a "
                                       "string, got number"):
    locomo.load_locomo(_write(tmp_path, [conv]))


def test_longmemeval_answers_question_dates_and_session_dates():
  c = longmemeval.load_longmemeval(FIXTURES / "longmemeval_tiny.json")
  raw = json.loads((FIXTURES / "longmemeval_tiny.json").read_text())
  by_id = {item["question_id"]: item for item in raw}
  for q in c.queries:
    assert q.answer == str(by_id[q.id]["answer"]) and q.date == by_id[q.id]["question_date"]
    bank = c.banks[q.group]
    item = by_id[q.id]
    session_date = dict(zip(item["haystack_session_ids"], item["haystack_dates"]))
    assert bank.dates == [session_date[i.rsplit("_", 1)[0]] for i in bank.ids]


@pytest.mark.parametrize("mutate, match", [
    (lambda it: it.update(haystack_dates=it["haystack_dates"][:1]),
     "1 haystack_dates but 2 haystack_sessions"),
    (lambda it: it["haystack_dates"].__setitem__(0, 5),
     "field 'haystack_dates' entry 0 must be a string, got number"),
    (lambda it: it.update(answer={"a": 1}), "field 'answer' must be a string or a number"),
    (lambda it: it.update(question_date=3), "field 'question_date' must be a string or null"),
])
def test_longmemeval_malformed_dates_and_answers_name_the_question(tmp_path, mutate, match):
  raw = json.loads((FIXTURES / "longmemeval_tiny.json").read_text())
  raw = copy.deepcopy(raw)
  assert len(raw[0]["haystack_dates"]) == 2
  mutate(raw[0])
  p = _write(tmp_path, raw, "longmemeval_s.json")
  with pytest.raises(ValueError, match=match) as e:
    longmemeval.load_longmemeval(p)
  assert str(p) in str(e.value) and repr(raw[0]["question_id"]) in str(e.value)
