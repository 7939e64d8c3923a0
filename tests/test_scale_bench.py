"""`scale_bench` on a tiny bank: every field, and the relations its numbers must satisfy."""
import json

import numpy as np
import pytest

from ear_jax.experiment import scale_bench


@pytest.mark.slow
def test_scale_bench_tiny_run_fields_bounds_and_persistence(tmp_path):
  res = scale_bench.run([300, 1200], ["exact", "bf16", "ivf", "pq"], dim=16, calls=8, batch=8,
                        save_dir=str(tmp_path), peak_sizes=(64,), bandwidth_bytes=4e6)
  json.dumps(res)  # serialisable
  assert len(res["rows"]) == 8 and res["bandwidth"]["gb_per_s"] > 0 and res["peak"]["gflops"] > 0
  for r in res["rows"]:
    itemsize = 2 if r["path"] == "bf16" else 4
    bound = r["M"] * 16 * itemsize / (res["bandwidth"]["gb_per_s"] * 1e9) * 1e3
    assert np.isclose(r["bound_b1_ms"], bound)
    assert r["bound_batch_ms"] >= r["bound_b1_ms"]
    assert r["search_b1"]["p50_ms"] <= r["search_b1"]["p90_ms"]
    assert r["round_b1"]["n"] == 8 and r["feedback_learner_step"]["n"] == 2  # b = 4
    assert r["search_batch"]["queries"] == 8 and r["search_batch"]["queries_per_s"] > 0
    # bytes per memory: at least the embedding itself (the capacity is >= M)
    assert r["device_bytes_per_memory"] >= 16 * itemsize
  ivf = [r for r in res["rows"] if r["path"] in ("ivf", "pq")]
  assert all(r["recall_at_k"] == 1.0 for r in ivf)  # below the training size: searched exactly
  exact = [r for r in res["rows"] if r["path"] == "exact"]
  for r in exact:
    assert r["memories"] == r["M"] + 3000  # the reopened memory holds every add
    assert len(r["save_after_1000_all_s"]) == 3 and r["save_nothing_added_s"] > 0
    assert len(r["load_all_s"]) == 3 and r["load_s"] > 0
    assert r["add_one"]["n"] == 20 and r["search_after_add_one"]["n"] == 20
    # the table holds each row's float32 embedding, its id / text / date and digest (< 250 bytes
    # here); the learner item the learner state, not the replay buffer's candidates (bank rows)
    assert (r["M"] + 3000) * 16 * 4 <= r["table_bytes"] < (r["M"] + 3000) * (16 * 4 + 250) + 1e6
    assert 0 < r["learner_bytes"] < 2048 * 20 * 16 * 4
  assert not list(tmp_path.iterdir())  # the saved directories are removed
  text = scale_bench.table(res)
  assert "| exact (random) | 1,200 |" in text and "| 1,200 | " in text
  assert "(measured at 1M, d = 384)" in text  # no ratio to the 1M baseline at other sizes
  scale_bench.plot(res, str(tmp_path / "p.png"))
  assert (tmp_path / "p.png").stat().st_size > 1000
