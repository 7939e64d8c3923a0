"""JSON citation prompts and parsing, constrained decoding in the critic, and the critic metrics."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ear_jax.agent.llm.citations import (PROMPTS, build_messages, citation_schema,
                                         judgement_schema, parse_json_citations, parse_reply)
from ear_jax.agent.llm.critic import LLMCritic, LLMCriticConfig
from ear_jax.experiment.critic_eval import SlateRecord, citation_metrics, select_slates

from tests.llm_fakes import Reply

_MEMORIES = ["Alice moved to Paris in May.", "Bob likes chess.", "The cat is called Tom."]


@pytest.mark.parametrize("text, expected", [
    ('{"cited": [2, 0]}', (0, 2)),
    ('{"cited": [1, 1]}', (1,)),
    ('{"cited": []}', ()),
    ('```json\n{"answer": "Paris", "cited": [0]}\n```', (0,)),
    ('The answer is:\n{"cited": [2]}', (2,)),
    ('{"useful": [true, false, true]}', (0, 2)),
    ('{"useful": [false, false, false]}', ()),
])
def test_json_replies_are_parsed(text, expected):
  assert parse_reply(text, 3) == expected


@pytest.mark.parametrize("text", [
    '{"cited": [3]}', '{"cited": [-1]}', '{"cited": [true]}', '{"cited": ["0"]}',
    '{"cited": 0}', '{"answer": "x"}', '{"useful": [true, false]}', '{"useful": [1, 0, 1]}',
    '{"cited": [0.0]}'])
def test_invalid_json_citations_are_unusable_not_read_as_free_text(text):
  assert parse_json_citations(text, 3) is None and parse_reply(text, 3) is None


@pytest.mark.parametrize("text, expected", [
    ("Paris.\n[0, 2]", (0, 2)), ("No.\n[NO_CITE]", ()), ("nothing", None), ("", None),
    ('{"cited": [0', None), ("{not json} [1]", (1,))])
def test_replies_without_a_json_object_fall_back_to_the_free_text_parser(text, expected):
  assert parse_reply(text, 3) == expected


def test_schemas_allow_exactly_the_valid_citations():
  schema = citation_schema(3)
  assert schema["properties"]["cited"]["items"]["enum"] == [0, 1, 2]
  assert schema["properties"]["cited"]["maxItems"] == 3 and schema["required"] == ["cited"]
  assert list(citation_schema(2, with_answer=True)["properties"]) == ["answer", "cited"]
  useful = judgement_schema(4)["properties"]["useful"]
  assert useful["minItems"] == useful["maxItems"] == 4


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_prompts_show_no_concrete_citation_to_copy(prompt):
  instruction = PROMPTS[prompt].instruction
  if prompt != "free_text":  # the free-text format needs its example line
    assert not any(f"[{i}" in instruction for i in range(5))
  user = build_messages("Where?", _MEMORIES, prompt=prompt)[-1]["content"]
  assert user.endswith(instruction) and "[2] The cat is called Tom." in user


def _critic(srv, **overrides) -> LLMCritic:
  kwargs = dict(base_url=srv.base_url, model=srv.model, timeout_s=2.0, max_retries=0)
  kwargs.update(overrides)
  return LLMCritic(LLMCriticConfig(**kwargs), sleep=lambda s: None)


def test_the_critic_sends_the_schema_as_response_format(fake_llm):
  srv = fake_llm(lambda request: '{"useful": [false, true, false]}')
  result = _critic(srv).critique("Who likes chess?", _MEMORIES)
  body = srv.requests[0]["json"]
  assert body["response_format"] == {"type": "json_object", "schema": judgement_schema(3)}
  assert result.cited == (1,) and result.constrained
  srv = fake_llm(lambda request: '{"cited": [1]}')
  result = _critic(srv, prompt="cite_json").critique("Who likes chess?", _MEMORIES)
  body = srv.requests[0]["json"]
  assert body["response_format"] == {"type": "json_object", "schema": citation_schema(3)}
  assert result.cited == (1,) and result.constrained
  np.testing.assert_array_equal(result.labels, [-1, 1, -1])


def test_unconstrained_and_free_text_critics_send_no_response_format(fake_llm):
  srv = fake_llm(lambda request: "Bob.\n[1]")
  assert _critic(srv, constrained=False).critique("Who?", _MEMORIES).cited == (1,)
  assert _critic(srv, prompt="free_text").critique("Who?", _MEMORIES).cited == (1,)
  assert all("response_format" not in r["json"] for r in srv.requests)


def test_an_endpoint_rejecting_response_format_gets_the_free_parse(fake_llm):
  def respond(request):
    if "response_format" in request:
      return Reply(status=400, raw_body=b'{"error": "unknown field response_format"}')
    return 'Sure: {"cited": [0]}'

  srv = fake_llm(respond)
  critic = _critic(srv)
  results = [critic.critique("Where did Alice move?", _MEMORIES) for _ in range(3)]
  assert [r.cited for r in results] == [(0,)] * 3 and not any(r.constrained for r in results)
  assert [("response_format" in r["json"]) for r in srv.requests] == [True, False, False, False]
  assert critic.client.stats["response_format_fallbacks"] == 1 and critic.stats["ok"] == 3


@pytest.mark.parametrize("reply", ["", "   ", "I cannot help.", '{"cited": [9]}', "\x00\x01",
                                   '{"useful": [true]}'])
def test_garbage_and_empty_replies_are_counted_unusable_never_a_crash(fake_llm, reply):
  srv = fake_llm(lambda request: reply)
  critic = _critic(srv)
  result = critic.critique("Where?", _MEMORIES)
  assert result.status == "unparseable" and result.labels is None
  assert critic.stats["unparseable"] == 1 and critic.client.stats["unusable"] == 1


def test_the_critic_resumes_from_its_cache(fake_llm, tmp_path):
  calls = []
  srv = fake_llm(lambda request: calls.append(1) or '{"cited": [2]}')
  for _ in range(2):
    critic = _critic(srv, cache_dir=str(tmp_path))
    result = critic.critique("What is the cat called?", _MEMORIES)
    assert result.cited == (2,)
  assert len(calls) == 1 and result.cached and critic.client.stats["cache_hits"] == 1


def test_bad_prompt_name_is_a_value_error():
  with pytest.raises(ValueError, match="prompt"):
    LLMCriticConfig(base_url="http://localhost:1/v1", model="m", prompt="nope")
  with pytest.raises(ValueError, match="constrained"):
    LLMCriticConfig(base_url="http://localhost:1/v1", model="m", constrained="yes")


# ---------------------------------------------------------------------------------------------------
# critic metrics


def _slate(gold, q=0):
  return SlateRecord(query=q, round=0, question="q", texts=tuple("m" for _ in gold),
                     gold=tuple(gold))


def test_citation_metrics_on_a_hand_worked_example():
  slates = [_slate([1, 0, 0, 0, 0]), _slate([0, 1, 1, 0, 0]), _slate([0, 0, 0, 0, 0]),
            _slate([1, 0, 0, 0, 0]), _slate([0, 0, 0, 0, 1])]
  cited = [[0, 1], [2], [3], None, []]
  m = citation_metrics(slates, cited)
  # gold slates with a usable reply: 1 (TP 1 of 2 cited, 1 gold), 2 (TP 1 of 1, 2 gold), 5 (0 of 0, 1)
  assert m["usable"] == 4 and m["parse_rate"] == 0.8 and m["gold_slates"] == 3
  assert m["precision"] == pytest.approx(2 / 3) and m["recall"] == pytest.approx(2 / 4)
  assert m["f1"] == pytest.approx(2 * (2 / 3) * 0.5 / (2 / 3 + 0.5))
  assert m["chance_precision"] == pytest.approx(4 / 15)
  assert m["first_precision"] == pytest.approx(1 / 3) and m["first_recall"] == pytest.approx(1 / 4)
  assert m["cited_per_slate"] == 1.0 and m["gold_per_slate"] == pytest.approx(4 / 3)
  assert m["gold_free_slates"] == 1 and m["gold_free_cited_per_slate"] == 1.0
  assert m["gold_free_any_cited"] == 1.0
  assert m["position_cite_rate"] == pytest.approx([0.25, 0.25, 0.25, 0.25, 0.0])


def test_citation_metrics_without_citations_are_nan_not_an_error():
  m = citation_metrics([_slate([1, 0])], [None])
  assert m["usable"] == 0 and math.isnan(m["precision"]) and math.isnan(m["recall"])
  with pytest.raises(ValueError, match="citation lists"):
    citation_metrics([_slate([1])], [])


def test_select_slates_takes_each_querys_first_gold_slate():
  records = [SlateRecord(0, 0, "a", ("x",), (False,)), SlateRecord(0, 1, "a", ("y",), (True,)),
             SlateRecord(0, 2, "a", ("z",), (True,)), SlateRecord(1, 0, "b", ("u",), (False,)),
             SlateRecord(1, 1, "b", ("v",), (False,))]
  gold, free = select_slates(records)
  assert gold == [records[1]] and free == [records[3]]
  assert json.dumps([g.texts for g in gold]) == '[["y"]]'


@pytest.mark.slow  # compiles the learner step (~10 s)
def test_recorded_slates_are_the_views_the_episode_showed():
  import types  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from ear_jax.core.config import EARConfig, default_hparams  # pylint: disable=import-outside-toplevel
  from ear_jax.experiment.critic_eval import record_training_slates  # pylint: disable=import-outside-toplevel
  from tests.core_utils import learnable_stream  # pylint: disable=import-outside-toplevel
  n, k = 7, 8
  stream = learnable_stream(0, n, d=16, k=k, num_gold=2)
  texts = np.array([[f"q{i}c{j}" for j in range(k)] for i in range(n)])
  bench = types.SimpleNamespace(stream=stream, query_texts=[f"question {i}" for i in range(n)],
                                candidate_texts=texts)
  config = EARConfig(dim=16, num_candidates=k, slate_size=3, num_rounds=2, batch_size=4,
                     buffer_capacity=16, replay_size=2)
  records = record_training_slates(jax.random.PRNGKey(0), bench, config, default_hparams())
  assert len(records) == n * 2
  assert sorted((r.query, r.round) for r in records) == [(i, t) for i in range(n) for t in (0, 1)]
  gold = np.asarray(stream.gold)
  for r in records:
    assert r.question == f"question {r.query}" and len(r.texts) == 3
    for text, g in zip(r.texts, r.gold):
      row, col = (int(x) for x in text[1:].split("c"))
      assert row == r.query and g == bool(gold[row, col])
