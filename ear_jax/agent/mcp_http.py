"""The MCP server's streamable HTTP transport: loopback by default with Host / Origin checks, an
optional bearer token (required off loopback)."""
import hmac
import ipaddress
from typing import Optional


def is_loopback(host: str) -> bool:
  """True for 'localhost' and loopback addresses (127.0.0.0/8, ::1)."""
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host.strip("[]")).is_loopback
  except ValueError:
    return False


def transport_security(host: str, port: int):
  """The Host / Origin checks of HTTP on a loopback `host` (421 / 403); None elsewhere."""
  from mcp.server.transport_security import TransportSecuritySettings  # pylint: disable=g-import-not-at-top
  if not is_loopback(host):
    return None
  if host in ("127.0.0.1", "localhost", "::1", "[::1]"):
    names = ["127.0.0.1", "localhost", "[::1]"]
  else:
    name = host.strip("[]")
    names = [f"[{name}]" if ":" in name else name]
  return TransportSecuritySettings(
      enable_dns_rebinding_protection=True, allowed_hosts=[f"{n}:{port}" for n in names],
      allowed_origins=[f"http://{n}:{port}" for n in names])


class BearerAuth:
  """ASGI middleware: 401 unless `Authorization: Bearer <token>` (compared in constant time)."""

  def __init__(self, app, token: str):
    self.app, self._token = app, token.encode()

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http":
      got = dict(scope.get("headers") or []).get(b"authorization", b"")
      if not hmac.compare_digest(got, b"Bearer " + self._token):
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"text/plain"),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": b"missing or wrong bearer token"})
        return
    await self.app(scope, receive, send)


def serve_http(mcp, host: str, port: int, token: Optional[str]) -> None:
  """Streamable HTTP at `http://host:port/mcp` (uvicorn), behind `BearerAuth` when `token`."""
  import uvicorn  # pylint: disable=g-import-not-at-top
  app = mcp.streamable_http_app()
  if token:
    app = BearerAuth(app, token)
  uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).run()
