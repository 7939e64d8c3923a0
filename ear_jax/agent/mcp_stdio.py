"""The MCP server's stdio transport: the `mcp` SDK's, with a stdin that answers every request.

The SDK drops invalid messages without a reply (its client waits forever). `_StdinLines` passes on
only the lines the SDK can read (strict UTF-8, a JSON-RPC message) and answers any other line with
an id with a JSON-RPC error, on a stdout shared one whole line at a time.
"""
from __future__ import annotations

import json
import sys
from typing import Optional


def _request_id(obj):
  """The id of a parsed JSON-RPC message (a str or int, never a bool), else None."""
  rid = obj.get("id") if isinstance(obj, dict) else None
  if isinstance(rid, bool) or not isinstance(rid, (int, str)) or _lone_surrogate(rid):
    return None
  return rid


def _lone_surrogate(obj) -> bool:
  """True when a string in `obj` (parsed JSON) holds a lone UTF-16 surrogate (not Unicode text)."""
  try:
    json.dumps(obj, ensure_ascii=False).encode("utf-8")
  except UnicodeEncodeError:
    return True
  return False


def _error_line(obj, code: int, message: str) -> Optional[str]:
  """The JSON-RPC error answering `obj`, or None for a notification or a response."""
  if isinstance(obj, dict) and "id" not in obj and "method" in obj or (
      isinstance(obj, dict) and "method" not in obj and ("result" in obj or "error" in obj)):
    print(f"ear-mcp: ignored a malformed notification or response: {message}", file=sys.stderr)
    return None
  return json.dumps({"jsonrpc": "2.0", "id": _request_id(obj),
                     "error": {"code": code, "message": message}})


def check_stdio_line(raw: bytes) -> tuple[Optional[str], Optional[str]]:
  """One stdin line -> (line, None) if the SDK can read it, else (None, its error or None)."""
  import pydantic  # pylint: disable=g-import-not-at-top
  from mcp import types  # pylint: disable=g-import-not-at-top
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    try:
      obj = json.loads(raw.decode("utf-8", "replace"))  # only to read the id
    except ValueError:
      obj = None
    return None, _error_line(obj, types.PARSE_ERROR, f"Parse error: invalid UTF-8 at byte {e.start} "
                             "of the message; JSON-RPC messages must be UTF-8 text")
  if not text.strip():
    return None, None
  try:
    types.JSONRPCMessage.model_validate_json(text)
    return text, None
  except pydantic.ValidationError as e:
    json_invalid = any(err.get("type") == "json_invalid" for err in e.errors())
  try:
    obj = json.loads(text)
  except ValueError as e:
    return None, _error_line(None, types.PARSE_ERROR, f"Parse error: not JSON ({e})")
  if _lone_surrogate(obj):
    return None, _error_line(obj, types.PARSE_ERROR, "Parse error: a string holds a lone UTF-16 "
                             "surrogate (such as \\ud800), which is not Unicode text")
  if json_invalid:
    return None, _error_line(obj, types.PARSE_ERROR, "Parse error: not valid JSON")
  if isinstance(obj, dict) and "params" in obj and not isinstance(obj["params"], dict):
    return None, _error_line(obj, types.INVALID_PARAMS, "Invalid params: params must be an "
                             f"object, got {type(obj['params']).__name__}")
  return None, _error_line(obj, types.INVALID_REQUEST, "Invalid Request: not a JSON-RPC 2.0 "
                           "request, notification or response")


class _LockedWriter:
  """stdout shared by the SDK's writer and `_StdinLines`' errors: one whole line at a time."""

  def __init__(self, file):
    import anyio  # pylint: disable=g-import-not-at-top
    self._file, self._lock = file, anyio.Lock()

  async def write(self, text: str) -> None:
    async with self._lock:
      await self._file.write(text)

  async def flush(self) -> None:
    async with self._lock:
      await self._file.flush()


class _StdinLines:
  """The `stdin` the SDK reads: lines it can read passed on, others with an id answered here."""

  def __init__(self, binary_stdin, stdout: _LockedWriter):
    self._stdin, self._stdout = binary_stdin, stdout

  async def __aiter__(self):
    import anyio  # pylint: disable=g-import-not-at-top
    while raw := await anyio.to_thread.run_sync(self._stdin.readline):
      line, error = check_stdio_line(raw)
      if line is not None:
        yield line
      elif error is not None:
        await self._stdout.write(error + "\n")
        await self._stdout.flush()


def serve_stdio(mcp) -> None:
  """Serves `mcp` (`build_server`) on stdin / stdout until stdin ends."""
  import io  # pylint: disable=g-import-not-at-top
  import anyio  # pylint: disable=g-import-not-at-top
  from mcp.server.stdio import stdio_server  # pylint: disable=g-import-not-at-top

  async def go():
    stdout = _LockedWriter(anyio.wrap_file(io.TextIOWrapper(sys.stdout.buffer, encoding="utf-8")))
    async with stdio_server(_StdinLines(sys.stdin.buffer, stdout), stdout) as (read, write):
      server = mcp._mcp_server  # pylint: disable=protected-access  (as FastMCP.run_stdio_async)
      await server.run(read, write, server.create_initialization_options())
  anyio.run(go)
