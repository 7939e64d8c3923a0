"""Tests of ear_jax/agent/llm/critic.py against a real chat-completions HTTP server on 127.0.0.1."""
from __future__ import annotations

import dataclasses
import logging
import random
import socket
import time

import numpy as np
import pytest

from ear_jax.agent.llm import critic as llm_critic
from ear_jax.agent.llm.critic import (CriticResult, LLMCritic, LLMCriticConfig, build_messages,
                                      format_citations, labels_from_citations, parse_citations)
from tests.llm_fakes import RecordingSleep as _RecordingSleep
from tests.llm_fakes import KEY_ENV, Reply, make_client

_KEY_ENV = KEY_ENV
_MEMORIES = ["Alice moved to Paris in May.", "Bob likes\n chess.", "The cat is called Tom."]
_QUESTION = "Where did Alice move?"


def _client(server, sleep=None, **overrides) -> LLMCritic:
  return make_client(server, sleep, client_cls=LLMCritic, config_cls=LLMCriticConfig, **overrides)


# ---------------------------------------------------------------------------------------------------
# parse_citations


@pytest.mark.parametrize("text, expected", [
    ("[0, 2]", (0, 2)),
    ("[0,2]", (0, 2)),
    ("[2]", (2,)),
    ("[ 1 ,0 ]", (0, 1)),
    ("[2, 0]", (0, 2)),
    ("[NO_CITE]", ()),
    ("[no_cite]", ()),
    ("[ NO_CITE ]", ()),
    ("Alice moved to Paris.\n[0, 1]", (0, 1)),
    ("Alice moved to Paris [0] with Bob [1].\n[1]", (1,)),
    ("Nothing here helps.\n[NO_CITE]\n", ()),
    ("Answer.\nCitations: [0, 3].", (0, 3)),
    ("[1, 1]", (1,)),
    ("[3, 0, 3]", (0, 3)),
    ("[[0, 2]]", (0, 2)),
    ("[0, 1, 2, 3, 4]", (0, 1, 2, 3, 4)),
])
def test_parse_citations_accepts_well_formed_lists(text, expected):
  assert parse_citations(text, num_memories=5) == expected


@pytest.mark.parametrize("text", [
    "",
    "Alice moved to Paris.",
    "[]",
    "[ ]",
    "[5]",
    "[0, 5]",
    "[17]",
    "[-1]",
    "[0, -1]",
    "[1.5]",
    "[a]",
    "[0, a]",
    "[+1]",
    "[0 2]",
    "[0, 2,]",
    "[,0]",
    "[0;2]",
    "[NO_CITE, 1]",
    "[NO CITE]",
    "[NONE]",
    "[Memory 0]",
    "[0, 2] and then [sic]",
    "[0, 2]\n[9]",
    "0, 2",
    "(0, 2)",
    "[0, 2",
    "[１]",  # a full-width digit is not an ASCII decimal integer
])
def test_parse_citations_rejects_malformed_or_out_of_range(text):
  assert parse_citations(text, num_memories=5) is None


def test_parse_citations_takes_the_last_list():
  assert parse_citations("First I thought [0, 1]. Final:\n[2]", 3) == (2,)
  assert parse_citations("[NO_CITE] at first, but then\n[1]", 3) == (1,)
  assert parse_citations("[0, 1]\n[NO_CITE]", 3) == ()


def test_parse_citations_bounds_by_num_memories():
  assert parse_citations("[2]", 3) == (2,)
  assert parse_citations("[3]", 3) is None
  assert parse_citations("[0]", 0) is None
  assert parse_citations("[NO_CITE]", 0) == ()
  with pytest.raises(ValueError, match="num_memories"):
    parse_citations("[0]", -1)


def test_parse_citations_returns_none_for_non_string():
  assert parse_citations(None, 3) is None  # type: ignore[arg-type]


def test_labels_from_citations_gives_plus_one_for_cited_and_minus_one_otherwise():
  labels = labels_from_citations((0, 2), 5)
  assert labels.dtype == np.float32 and labels.shape == (5,)
  np.testing.assert_array_equal(labels, [1, -1, 1, -1, -1])
  np.testing.assert_array_equal(labels_from_citations((), 3), [-1, -1, -1])
  with pytest.raises(ValueError, match="outside the slate of size 3"):
    labels_from_citations((3,), 3)
  with pytest.raises(ValueError, match="outside the slate"):
    labels_from_citations((-1,), 3)


def test_build_messages_numbers_memories_from_zero_and_includes_question():
  messages = build_messages(_QUESTION, _MEMORIES)
  assert [m["role"] for m in messages] == ["system", "user"]
  user = messages[1]["content"]
  assert "[0] Alice moved to Paris in May.\n[1] Bob likes chess.\n[2] The cat is called Tom." in user
  assert f"Question: {_QUESTION}" in user
  assert "[NO_CITE]" in user and "[0, 2]" in user


# ---------------------------------------------------------------------------------------------------
# Construction errors


@pytest.mark.parametrize("base_url, message", [
    ("", "non-empty"),
    ("localhost:8000/v1", "http:// or https://"),
    ("ftp://localhost/v1", "http:// or https://"),
    ("http:///v1", "no host"),
    ("http://localhost:80a/v1", "not a valid URL"),
    ("http://localhost:8000/v1?x=1", "query string"),
])
def test_malformed_base_url_is_a_value_error_naming_it(base_url, message):
  with pytest.raises(ValueError, match=message):
    LLMCriticConfig(base_url=base_url, model="m")


@pytest.mark.parametrize("field, value", [
    ("model", ""), ("timeout_s", 0.0), ("max_retries", -1), ("max_tokens", 0),
    ("backoff_base_s", -1.0), ("api_key_env", ""),
])
def test_bad_config_values_are_value_errors_naming_the_field(field, value):
  kwargs = {"base_url": "http://localhost:8000/v1", "model": "m", field: value}
  with pytest.raises(ValueError, match=field):
    LLMCriticConfig(**kwargs)


@pytest.mark.parametrize("base_url, url", [
    ("http://localhost:8000/v1", "http://localhost:8000/v1/chat/completions"),
    ("http://localhost:8000/v1/", "http://localhost:8000/v1/chat/completions"),
    ("https://api.example.com/v1/chat/completions", "https://api.example.com/v1/chat/completions"),
])
def test_endpoint_url_is_built_from_base_url(base_url, url):
  assert LLMCritic(LLMCriticConfig(base_url=base_url, model="m")).url == url


def test_empty_memories_or_question_are_value_errors(server):
  server.script = [Reply()]
  client = _client(server)
  with pytest.raises(ValueError, match="memory_texts is empty"):
    client.critique(_QUESTION, [])
  with pytest.raises(ValueError, match="question"):
    client.critique("  ", _MEMORIES)
  with pytest.raises(ValueError, match=r"memory_texts\[1\]"):
    client.critique(_QUESTION, ["a", None])
  assert server.requests == [] and client.stats["calls"] == 0


# ---------------------------------------------------------------------------------------------------
# Against the loopback server


def test_well_formed_citations_give_labels(server, monkeypatch):
  monkeypatch.setenv(_KEY_ENV, "sk-test-123")
  server.script = [Reply(content="Alice moved to Paris [0].\n[0, 2]")]
  client = _client(server)
  result = client.critique(_QUESTION, _MEMORIES)
  assert isinstance(result, CriticResult)
  assert result.status == "ok" and result.error is None and result.attempts == 1
  assert result.cited == (0, 2)
  np.testing.assert_array_equal(result.labels, np.array([1, -1, 1], np.float32))
  assert result.labels.dtype == np.float32
  assert result.raw_text == "Alice moved to Paris [0].\n[0, 2]"
  assert client.stats == {"calls": 1, "ok": 1, "unparseable": 0, "http_error": 0, "timeout": 0,
                          "connection_error": 0, "retries": 0}


def test_request_carries_key_model_question_and_numbered_memories(server, monkeypatch):
  monkeypatch.setenv(_KEY_ENV, "sk-test-123")
  server.script = [Reply()]
  _client(server, temperature=0.25, max_tokens=77).critique(_QUESTION, _MEMORIES)
  (request,) = server.requests
  assert request["path"] == "/v1/chat/completions"
  assert request["headers"]["Authorization"] == "Bearer sk-test-123"
  assert request["headers"]["Content-Type"] == "application/json"
  body = request["json"]
  assert body["model"] == "test-model"
  assert body["temperature"] == 0.25 and body["max_tokens"] == 77
  assert body["messages"][0]["role"] == "system"
  prompt = body["messages"][-1]["content"]
  assert body["messages"][-1]["role"] == "user"
  for i, text in enumerate(_MEMORIES):
    assert f"[{i}] {' '.join(text.split())}" in prompt
  assert _QUESTION in prompt


def test_missing_key_sends_no_authorization_header(server, monkeypatch):
  monkeypatch.delenv(_KEY_ENV, raising=False)
  server.script = [Reply()]
  result = _client(server).critique(_QUESTION, _MEMORIES)
  assert result.status == "ok"
  assert "Authorization" not in server.requests[0]["headers"]


def test_key_is_read_from_the_configured_variable_name(server, monkeypatch):
  monkeypatch.setenv(_KEY_ENV, "wrong")
  monkeypatch.setenv("MY_OTHER_KEY", "right")
  server.script = [Reply()]
  _client(server, api_key_env="MY_OTHER_KEY").critique(_QUESTION, _MEMORIES)
  assert server.requests[0]["headers"]["Authorization"] == "Bearer right"


def test_no_cite_gives_all_negative_labels(server):
  server.script = [Reply(content="None of these help.\n[NO_CITE]")]
  result = _client(server).critique(_QUESTION, _MEMORIES)
  assert result.status == "ok" and result.cited == ()
  np.testing.assert_array_equal(result.labels, [-1, -1, -1])


@pytest.mark.parametrize("content", [
    "Alice moved to Paris.",  # no list
    "Paris.\n[0, 7]",  # out of range
    "Paris.\n[0, x]",  # not an integer
    "",
    None,
])
def test_unparseable_reply_gives_no_labels_and_is_counted_and_logged(server, content, caplog):
  server.script = [Reply(content=content)]
  client = _client(server)
  with caplog.at_level(logging.WARNING):
    result = client.critique(_QUESTION, _MEMORIES)
  assert result.status == "unparseable" and result.labels is None and result.cited is None
  assert result.attempts == 1 and len(server.requests) == 1  # not retried
  assert result.raw_text == (content or "")
  assert "citation" in result.error
  assert client.stats["unparseable"] == 1 and client.stats["ok"] == 0 and client.stats["calls"] == 1
  assert any("unparseable" in r.getMessage() for r in caplog.records)


def test_non_json_body_is_unparseable_not_a_crash(server):
  server.script = [Reply(raw_body=b"<html>oops</html>")]
  client = _client(server)
  result = client.critique(_QUESTION, _MEMORIES)
  assert result.status == "unparseable" and result.labels is None
  assert "chat-completions" in result.error and result.attempts == 1


def test_http_500_then_success_is_retried_with_backoff(server):
  server.script = [Reply(status=500), Reply(status=503), Reply(content="Paris.\n[1]")]
  sleep = _RecordingSleep()
  client = _client(server, sleep=sleep, max_retries=3, backoff_base_s=0.01, backoff_max_s=1.0)
  result = client.critique(_QUESTION, _MEMORIES)
  assert result.status == "ok" and result.cited == (1,) and result.attempts == 3
  assert len(server.requests) == 3
  assert client.stats["retries"] == 2 and client.stats["ok"] == 1 and client.stats["http_error"] == 0
  # Exponential with equal jitter: retry i waits in [c/2, c], c = 0.01 * 2**i.
  assert len(sleep.delays) == 2
  assert 0.005 <= sleep.delays[0] <= 0.01 and 0.01 <= sleep.delays[1] <= 0.02


def test_always_500_gives_up_without_raising(server, caplog):
  server.script = [Reply(status=500)]
  client = _client(server, max_retries=2)
  with caplog.at_level(logging.WARNING):
    result = client.critique(_QUESTION, _MEMORIES)
  assert result.status == "http_error" and result.labels is None and result.cited is None
  assert result.attempts == 3 and len(server.requests) == 3
  assert "HTTP 500" in result.error and "scripted 500" in result.error
  assert client.stats["http_error"] == 1 and client.stats["retries"] == 2
  assert any("http_error" in r.getMessage() for r in caplog.records)


def test_429_is_retried_and_retry_after_is_honoured_up_to_the_cap(server):
  server.script = [Reply(status=429, headers={"Retry-After": "0.05"}), Reply()]
  sleep = _RecordingSleep()
  client = _client(server, sleep=sleep, backoff_base_s=0.0, backoff_max_s=0.04)
  result = client.critique(_QUESTION, _MEMORIES)
  assert result.status == "ok" and result.attempts == 2
  assert sleep.delays == [pytest.approx(0.04)]  # Retry-After 0.05 capped at backoff_max_s


@pytest.mark.parametrize("status", [400, 401, 403, 404])
def test_client_errors_other_than_429_are_not_retried(server, status):
  server.script = [Reply(status=status), Reply()]
  client = _client(server, max_retries=3, constrained=False)  # (a 400 on response_format: below)
  result = client.critique(_QUESTION, _MEMORIES)
  assert result.status == "http_error" and result.labels is None
  assert result.attempts == 1 and len(server.requests) == 1
  assert f"HTTP {status}" in result.error
  assert client.stats["retries"] == 0 and client.stats["http_error"] == 1


def test_slow_reply_times_out_within_a_bounded_time(server):
  server.script = [Reply(delay_s=3.0)]
  client = _client(server, timeout_s=0.3, max_retries=1)
  start = time.monotonic()
  result = client.critique(_QUESTION, _MEMORIES)
  elapsed = time.monotonic() - start
  assert result.status == "timeout" and result.labels is None and result.attempts == 2
  assert elapsed < 1.5, elapsed  # two attempts of ~0.3 s, far below the server's 3 s
  assert client.stats["timeout"] == 1 and client.stats["retries"] == 1


def test_trickled_reply_is_cut_off_by_the_total_deadline(server):
  # Every byte arrives within the socket timeout, but the whole reply would take seconds.
  server.script = [Reply(trickle_s=0.02)]
  client = _client(server, timeout_s=0.3, max_retries=0)
  start = time.monotonic()
  result = client.critique(_QUESTION, _MEMORIES)
  assert result.status == "timeout" and result.attempts == 1
  assert time.monotonic() - start < 1.0


def test_slow_then_fast_reply_recovers_on_retry(server):
  server.script = [Reply(delay_s=3.0), Reply(content="[2]")]
  client = _client(server, timeout_s=0.3, max_retries=2)
  result = client.critique(_QUESTION, _MEMORIES)
  assert result.status == "ok" and result.cited == (2,) and result.attempts == 2
  assert client.stats["timeout"] == 0 and client.stats["retries"] == 1


def test_connection_refused_is_retried_then_reported():
  with socket.socket() as sock:  # a loopback port with nobody listening
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  sleep = _RecordingSleep()
  client = LLMCritic(LLMCriticConfig(base_url=f"http://127.0.0.1:{port}/v1", model="m",
                                     timeout_s=0.3, max_retries=2, backoff_base_s=0.0),
                     sleep=sleep, rng=random.Random(0))
  result = client.critique(_QUESTION, _MEMORIES)
  assert result.status == "connection_error" and result.labels is None and result.attempts == 3
  assert client.stats["connection_error"] == 1 and len(sleep.delays) == 2


def test_stats_accumulate_over_calls(server):
  server.script = [Reply(content="[0]"), Reply(content="junk"), Reply(status=401), Reply()]
  client = _client(server)
  statuses = [client.critique(_QUESTION, _MEMORIES).status for _ in range(4)]
  assert statuses == ["ok", "unparseable", "http_error", "ok"]
  assert client.stats == {"calls": 4, "ok": 2, "unparseable": 1, "http_error": 1, "timeout": 0,
                          "connection_error": 0, "retries": 0}


def test_backoff_is_exponential_capped_and_reproducible_with_a_seed():
  config = LLMCriticConfig(base_url="http://localhost:1/v1", model="m", backoff_base_s=1.0,
                           backoff_max_s=5.0)
  a = LLMCritic(config, rng=random.Random(7))
  b = LLMCritic(config, rng=random.Random(7))
  delays = [a.client.backoff_delay(i) for i in range(6)]
  assert delays == [b.client.backoff_delay(i) for i in range(6)]
  for i, d in enumerate(delays):
    cap = min(5.0, 2.0 ** i)
    assert cap / 2 <= d <= cap


def test_statuses_constant_lists_every_status():
  assert llm_critic.STATUSES == ("ok", "unparseable", "http_error", "timeout", "connection_error")


def test_public_names_stay_importable_from_llm_critic():
  import ear_jax  # pylint: disable=import-outside-toplevel
  for name in ("CriticResult", "LLMCritic", "LLMCriticConfig", "build_messages",
               "labels_from_citations", "parse_citations", "STATUSES", "format_memories"):
    assert hasattr(llm_critic, name), name
  # reached through its subpackage: the package's public face is the method alone
  assert "LLMCritic" not in ear_jax.__all__ and not hasattr(ear_jax, "LLMCriticConfig")


def test_critic_config_keeps_its_fields_and_checks_system_prompt():
  config = LLMCriticConfig(base_url="http://localhost:1/v1", model="m", system_prompt="Be terse.")
  assert config.system_prompt == "Be terse." and config.seed == 0 and config.max_retries == 3
  assert config.prompt == "judge_each_json" and config.constrained and config.temperature == 0.0
  with pytest.raises(ValueError, match="system_prompt"):
    LLMCriticConfig(base_url="http://localhost:1/v1", model="m", system_prompt=None)


def test_format_citations_is_read_back_by_the_parser():
  assert format_citations([2, 0, 2]) == "[0, 2]" and format_citations([]) == "[NO_CITE]"
  assert parse_citations("Answer.\n" + format_citations([3, 1]), 4) == (1, 3)


def test_system_prompt_and_seed_are_sent(server):
  _client(server, system_prompt="Be terse.", seed=11).critique(_QUESTION, _MEMORIES)
  body = server.requests[0]["json"]
  assert body["messages"][0] == {"role": "system", "content": "Be terse."} and body["seed"] == 11


# ---------------------------------------------------------------------------------------------------
# The critic protocol: critic(key, view)


@dataclasses.dataclass
class _View:
  """A stand-in for `ear_jax.core.critic.SlateView` (duck typing)."""
  query_text: str
  texts: tuple
  slate_mask: np.ndarray


def test_call_maps_citations_back_to_slate_positions(server):
  server.script = [Reply(content="Paris.\n[0, 2]")]
  critic = _client(server)
  view = _View(_QUESTION, tuple(_MEMORIES), np.array([True, False, True, True, False]))
  labels = critic(None, view)
  assert labels.dtype == np.float32 and labels.shape == (5,)
  np.testing.assert_array_equal(labels, [1, -1, -1, 1, -1])  # cited texts 0, 2 sit at slots 0, 3
  prompt = server.requests[0]["json"]["messages"][-1]["content"]
  assert "[0] Alice moved" in prompt and "[2] The cat" in prompt and "[3]" not in prompt
  assert critic.stats["ok"] == 1


def test_call_ignores_the_key_and_accepts_a_jax_mask(server):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  server.script = [Reply(content="[NO_CITE]")]
  view = _View(_QUESTION, ("a", "b"), jnp.array([True, True, False]))
  labels = _client(server)(jax.random.PRNGKey(3), view)
  np.testing.assert_array_equal(labels, [-1, -1, -1])


@pytest.mark.parametrize("reply", [Reply(content="no list"), Reply(status=500), Reply(status=401)])
def test_call_returns_none_for_an_unusable_reply(server, reply):
  server.script = [reply]
  critic = _client(server, max_retries=0)
  assert critic(None, _View(_QUESTION, ("a",), np.array([False, True]))) is None
  assert critic.stats["calls"] == 1 and critic.stats["ok"] == 0


def test_call_on_an_empty_slate_returns_none_without_a_request(server):
  critic = _client(server)
  assert critic(None, _View(_QUESTION, (), np.zeros(3, bool))) is None
  assert server.requests == [] and critic.stats["calls"] == 0


def test_call_accepts_texts_for_every_position(server):
  server.script = [Reply(content="[1]")]
  view = _View(_QUESTION, ("a", "", "c"), np.array([True, False, True]))
  np.testing.assert_array_equal(_client(server)(None, view), [-1, -1, 1])
  prompt = server.requests[0]["json"]["messages"][-1]["content"]
  assert "[0] a\n[1] c" in prompt


def test_call_with_the_library_slate_view(server):
  critic_lib = pytest.importorskip("ear_jax.core.critic")
  if not hasattr(critic_lib, "SlateView"):
    pytest.skip("ear_jax.core.critic has no SlateView")
  server.script = [Reply(content="[0]")]
  view = critic_lib.SlateView(
      query=np.zeros(2, np.float32), slate=np.array([4, -1, 7], np.int32),
      slate_mask=np.array([True, False, True]), memories=np.zeros((3, 2), np.float32),
      gold=np.zeros(3, bool), query_text=_QUESTION, texts=("m4", "m7"))
  np.testing.assert_array_equal(_client(server)(None, view), [1, -1, -1])
  without_text = view._replace(query_text=None, texts=None)
  with pytest.raises(TypeError, match="query_text"):
    _client(server)(None, without_text)


def test_call_checks_the_view(server):
  critic = _client(server)
  with pytest.raises(ValueError, match="3 texts for 1 non-empty"):
    critic(None, _View(_QUESTION, ("a", "b", "c"), np.array([True, False])))
  with pytest.raises(ValueError, match="1-D"):
    critic(None, _View(_QUESTION, ("a",), np.array([[True]])))
  with pytest.raises(TypeError, match="query_text"):
    critic(None, object())
  assert server.requests == []
