"""The chat client's on-disk reply cache, counters and response_format fallback (fake server)."""
from __future__ import annotations

import json
import logging

import pytest

from ear_jax.agent.llm.cache import ResponseCache, cache_endpoint, cache_key
from ear_jax.agent.llm.client import ChatClient, ChatClientConfig

from tests.llm_fakes import KEY_ENV, MESSAGES, Reply

_SCHEMA_FORMAT = {"type": "json_object", "schema": {"type": "object"}}


def _client(srv, tmp_path, **overrides) -> ChatClient:
  kwargs = dict(base_url=srv.base_url, model=srv.model, api_key_env=KEY_ENV, timeout_s=2.0,
                max_retries=1, backoff_base_s=0.0, backoff_max_s=0.0,
                cache_dir=str(tmp_path / "cache"))
  kwargs.update(overrides)
  return ChatClient(ChatClientConfig(**kwargs), sleep=lambda s: None)


def _counting(reply="fresh"):
  calls = []

  def respond(request):
    calls.append(request)
    return f"{reply} {len(calls)}"

  return respond, calls


def test_a_repeated_request_is_answered_from_the_cache(fake_llm, tmp_path):
  respond, calls = _counting()
  srv = fake_llm(respond)
  client = _client(srv, tmp_path)
  first = client.complete(MESSAGES)
  second = client.complete(MESSAGES)
  assert first.text == second.text == "fresh 1" and len(calls) == 1
  assert not first.cached and second.cached and second.attempts == 0
  assert client.stats["calls"] == 2 and client.stats["ok"] == 2 and client.stats["cache_hits"] == 1


def test_an_interrupted_run_resumes_from_the_cache_in_a_new_client(fake_llm, tmp_path):
  respond, calls = _counting()
  srv = fake_llm(respond)
  questions = [[{"role": "user", "content": f"q{i}"}] for i in range(5)]
  run1 = _client(srv, tmp_path)
  done = [run1.complete(q).text for q in questions[:3]]  # "interrupted" after 3 of 5
  run2 = _client(srv, tmp_path)
  again = [run2.complete(q).text for q in questions]
  assert again[:3] == done and len(calls) == 5  # only the 2 missing requests were sent
  assert run2.stats["cache_hits"] == 3 and run2.stats["calls"] == 5


@pytest.mark.parametrize("change", [
    {"temperature": 0.5}, {"seed": 7}, {"max_tokens": 9}, {"response_format": _SCHEMA_FORMAT}])
def test_decoding_settings_are_part_of_the_key(fake_llm, tmp_path, change):
  respond, calls = _counting()
  client = _client(fake_llm(respond), tmp_path)
  client.complete(MESSAGES)
  client.complete(MESSAGES, **change)
  assert len(calls) == 2 and client.stats["cache_hits"] == 0


def test_model_and_messages_are_part_of_the_key(fake_llm, tmp_path):
  respond, calls = _counting()
  srv = fake_llm(respond)
  _client(srv, tmp_path).complete(MESSAGES)
  _client(srv, tmp_path, model="other-model").complete(MESSAGES)
  _client(srv, tmp_path).complete(MESSAGES[:1])
  assert len(calls) == 3


def test_a_local_server_restarted_on_another_port_is_the_same_endpoint(fake_llm, tmp_path):
  respond, calls = _counting()
  first, restarted = fake_llm(respond), fake_llm(respond)  # two ports on 127.0.0.1
  assert first.base_url != restarted.base_url
  _client(first, tmp_path).complete(MESSAGES)
  assert _client(restarted, tmp_path).complete(MESSAGES).cached and len(calls) == 1


def test_remote_endpoints_are_part_of_the_key():
  body = {"model": "m", "messages": MESSAGES}
  keys = {cache_key(u, body) for u in ("https://a.example/v1/chat/completions",
                                        "https://a.example:8443/v1/chat/completions",
                                        "https://b.example/v1/chat/completions",
                                        "http://127.0.0.1:8000/v1/chat/completions")}
  assert len(keys) == 4
  assert (cache_key("http://127.0.0.1:8000/v1/chat/completions", body)
          == cache_key("http://localhost:9/v1/chat/completions", body))
  assert cache_endpoint("http://127.0.0.1:5/v1/chat/completions") == \
      "http://loopback/v1/chat/completions"


def test_the_api_key_is_not_key_material_and_is_never_stored(fake_llm, tmp_path, monkeypatch):
  respond, calls = _counting()
  srv = fake_llm(respond)
  monkeypatch.setenv(KEY_ENV, "sk-secret-key-0123456789")
  _client(srv, tmp_path).complete(MESSAGES)
  monkeypatch.setenv(KEY_ENV, "sk-another-key-987654321")
  assert _client(srv, tmp_path).complete(MESSAGES).cached  # the same entry: the key is not in it
  assert len(calls) == 1 and calls[0] is not None
  stored = b"".join(p.read_bytes() for p in (tmp_path / "cache").rglob("*") if p.is_file())
  assert stored and b"sk-secret" not in stored and b"sk-another" not in stored


def test_failures_are_not_cached(fake_llm, tmp_path):
  replies = iter([Reply(status=500), Reply(status=500), Reply(content="good")])
  srv = fake_llm(lambda request: next(replies))
  client = _client(srv, tmp_path)
  assert client.complete(MESSAGES).status == "http_error"
  assert client.complete(MESSAGES).text == "good"
  assert client.complete(MESSAGES).cached


def test_a_corrupted_entry_is_ignored_with_a_warning_and_replaced(fake_llm, tmp_path, caplog):
  respond, calls = _counting()
  srv = fake_llm(respond)
  client = _client(srv, tmp_path)
  client.complete(MESSAGES)
  (entry,) = list((tmp_path / "cache").rglob("*.json"))
  entry.write_text('{"version": 1, "text": ')  # a run killed mid-write without the atomic rename
  with caplog.at_level(logging.WARNING):
    result = _client(srv, tmp_path).complete(MESSAGES)
  assert result.status == "ok" and not result.cached and result.text == "fresh 2"
  assert "corrupted" in caplog.text and str(entry) in caplog.text
  assert json.loads(entry.read_text())["text"] == "fresh 2"  # rewritten whole


@pytest.mark.parametrize("content", ["[]", '{"text": 3, "version": 1}', "\x00\xff", "null"])
def test_garbage_entries_are_misses(tmp_path, content):
  cache = ResponseCache(tmp_path)
  key = cache_key("http://x/v1/chat/completions", {"model": "m"})
  cache.path(key).parent.mkdir(parents=True)
  cache.path(key).write_text(content, errors="surrogateescape")
  assert cache.get(key) is None


def test_an_entry_under_the_wrong_key_is_a_miss(tmp_path):
  cache = ResponseCache(tmp_path)
  a, b = cache_key("u", {"n": 1}), cache_key("u", {"n": 2})
  cache.put(a, "reply", {})
  cache.path(b).parent.mkdir(parents=True, exist_ok=True)
  cache.path(b).write_bytes(cache.path(a).read_bytes())
  assert cache.get(a) == ("reply", {}) and cache.get(b) is None


def test_cache_key_is_canonical():
  assert cache_key("u", {"a": 1, "b": [1, 2]}) == cache_key("u", {"b": [1, 2], "a": 1})
  assert cache_key("u", {"a": 1}) != cache_key("v", {"a": 1})


def test_an_unwritable_cache_never_breaks_the_call(fake_llm, tmp_path, caplog):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  srv = fake_llm(lambda request: "ok")
  client = _client(srv, tmp_path, cache_dir=str(tmp_path / "d"))
  client.cache.directory = blocker / "sub"  # a folder that cannot be created
  with caplog.at_level(logging.WARNING):
    assert client.complete(MESSAGES).text == "ok"
  assert "could not write" in caplog.text
  with pytest.raises(ValueError, match="not a folder"):
    ResponseCache(blocker)


def test_counters_sum_tokens_and_seconds_of_fresh_replies_only(fake_llm, tmp_path):
  srv = fake_llm(lambda request: Reply(content="x", usage={"prompt_tokens": 11,
                                                           "completion_tokens": 3}))
  client = _client(srv, tmp_path)
  for _ in range(3):
    client.complete(MESSAGES)
  client.complete([{"role": "user", "content": "another"}])
  stats = client.stats
  assert stats["calls"] == 4 and stats["cache_hits"] == 2
  assert stats["prompt_tokens"] == 22 and stats["completion_tokens"] == 6
  assert 0 < stats["seconds"] < 10


def test_defaults_are_temperature_zero_and_a_fixed_seed(fake_llm, tmp_path):
  srv = fake_llm(lambda request: "ok")
  _client(srv, tmp_path).complete(MESSAGES)
  body = srv.requests[0]["json"]
  assert body["temperature"] == 0.0 and body["seed"] == 0


def test_response_format_is_sent(fake_llm, tmp_path):
  srv = fake_llm(lambda request: '{"cited": []}')
  result = _client(srv, tmp_path).complete(MESSAGES, response_format=_SCHEMA_FORMAT)
  assert srv.requests[0]["json"]["response_format"] == _SCHEMA_FORMAT and result.constrained


@pytest.mark.parametrize("status", [400, 422])
def test_a_rejected_response_format_is_dropped_once_and_remembered(fake_llm, tmp_path, status):
  def respond(request):
    if "response_format" in request:
      return Reply(status=status)
    return "plain"

  srv = fake_llm(respond)
  client = _client(srv, tmp_path, cache_dir=None)
  first = client.complete(MESSAGES, response_format=_SCHEMA_FORMAT)
  second = client.complete(MESSAGES, response_format=_SCHEMA_FORMAT)
  assert first.status == second.status == "ok" and first.text == "plain"
  assert not first.constrained and not second.constrained and first.attempts == 2
  sent = ["response_format" in r["json"] for r in srv.requests]
  assert sent == [True, False, False]  # one rejected request, then never again
  assert client.stats["response_format_fallbacks"] == 1 and client.stats["calls"] == 2
  assert not client.response_format_supported


def test_other_errors_do_not_drop_response_format(fake_llm, tmp_path):
  srv = fake_llm(lambda request: Reply(status=401))
  client = _client(srv, tmp_path, max_retries=0)
  assert client.complete(MESSAGES, response_format=_SCHEMA_FORMAT).status == "http_error"
  assert len(srv.requests) == 1 and client.response_format_supported


@pytest.mark.parametrize("bad", ["json", {"schema": {}}, {"type": 3}])
def test_a_malformed_response_format_is_a_value_error(fake_llm, tmp_path, bad):
  srv = fake_llm(lambda request: "ok")
  with pytest.raises(ValueError, match="response_format"):
    _client(srv, tmp_path).complete(MESSAGES, response_format=bad)
  assert srv.requests == []


def test_a_bad_cache_dir_is_a_value_error():
  with pytest.raises(ValueError, match="cache_dir"):
    ChatClientConfig(base_url="http://localhost:1/v1", model="m", cache_dir="")


def test_fake_llm_answers_models_and_reports_respond_errors(fake_llm, tmp_path):
  def respond(request):
    raise KeyError("boom")

  srv = fake_llm(respond)
  result = _client(srv, tmp_path, max_retries=0).complete(MESSAGES)
  assert result.status == "http_error" and "respond raised KeyError" in result.error
