"""Tests for ear_jax/data/download.py against a loopback HTTP server (never the internet)."""
import functools
import hashlib
import http.server
import socket
import threading

import pytest

from ear_jax.data import corpora as datasets
from ear_jax.data import download
from ear_jax.data import sources


@pytest.fixture
def server(tmp_path):
  """Serves tmp_path/www on 127.0.0.1; yields (base_url, www dir)."""
  www = tmp_path / "www"
  www.mkdir()
  handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(www))
  handler.log_message = lambda *a: None
  httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  t = threading.Thread(target=httpd.serve_forever, daemon=True)
  t.start()
  yield f"http://127.0.0.1:{httpd.server_address[1]}", www
  httpd.shutdown()
  httpd.server_close()


def _put(www, url_path, data: bytes):
  p = www / url_path.lstrip("/")
  p.parent.mkdir(parents=True, exist_ok=True)
  p.write_bytes(data)


def test_locomo_download_verifies_sha256_and_writes_atomically(server, tmp_path, locomo_path):
  base, www = server
  _put(www, sources.SOURCES["locomo"][0].path, locomo_path.read_bytes())
  out = download.download("locomo", tmp_path / "data", base_url=base)
  assert out == tmp_path / "data" / "locomo10.json"
  assert hashlib.sha256(out.read_bytes()).hexdigest() == sources.LOCOMO_SHA256
  assert [p.name for p in (tmp_path / "data").iterdir()] == ["locomo10.json"]  # no temp left
  assert datasets.load_locomo(out).stats["queries"] == 1540


def test_wrong_sha256_is_an_error_and_leaves_nothing(server, tmp_path):
  base, www = server
  _put(www, sources.SOURCES["locomo"][0].path, b'[{"not": "locomo"}]')
  with pytest.raises(download.DownloadError, match="sha256"):
    download.download("locomo", tmp_path / "data", base_url=base)
  assert not any((tmp_path / "data").iterdir())


def test_fetch_checks_digest_of_arbitrary_bytes(server, tmp_path):
  base, www = server
  _put(www, "/x/f.json", b"[1, 2, 3]")
  dest = download.fetch(base + "/x/f.json", tmp_path / "f.json",
                        sha256=hashlib.sha256(b"[1, 2, 3]").hexdigest())
  assert dest.read_bytes() == b"[1, 2, 3]"


def test_longmemeval_falls_back_to_the_second_source(server, tmp_path):
  base, www = server
  cleaned, original = sources.SOURCES["longmemeval"]
  _put(www, original.path, b"[]")  # only the second source exists (the first gives 404)
  out = download.download("longmemeval", tmp_path / "data", base_url=base)
  assert out.name == original.filename and out.read_bytes() == b"[]"
  assert datasets.find_benchmark_file("longmemeval", tmp_path / "data") == out


def test_existing_file_is_not_fetched_again(tmp_path):
  (tmp_path / "locomo10.json").write_text("[]")
  assert download.download("locomo", tmp_path, base_url="http://127.0.0.1:9") == tmp_path / "locomo10.json"


def test_offline_error_says_which_file_to_put_where(tmp_path):
  with socket.socket() as s:  # a port with nobody listening
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  with pytest.raises(download.DownloadError) as e:
    download.download("locomo", tmp_path / "data", base_url=f"http://127.0.0.1:{port}", timeout=5)
  msg = str(e.value)
  assert str(tmp_path / "data" / "locomo10.json") in msg
  assert "https://github.com/snap-research/LoCoMo/raw/main/data/locomo10.json" in msg
  assert not (tmp_path / "data" / "locomo10.json").exists()


def test_results_record_data_files_relative_to_ear_data_dir(tmp_path, monkeypatch):
  from ear_jax.data import sources  # pylint: disable=g-import-not-at-top
  (tmp_path / "sub").mkdir()
  monkeypatch.setenv("EAR_DATA_DIR", str(tmp_path))
  assert sources.shown_path(tmp_path / "sub" / "locomo10.json") == "$EAR_DATA_DIR/sub/locomo10.json"
  assert sources.shown_path("/elsewhere/x.json") == "/elsewhere/x.json"
  monkeypatch.delenv("EAR_DATA_DIR")
  assert sources.shown_path(tmp_path / "x.json") == str(tmp_path / "x.json")
