"""The Fleet gateway: Flower's Fleet API, and nothing else, on the address the devices
reach, forwarded to the SuperLink on loopback.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pflower.flower.texts import FLEET_API  # the paths the gateway forwards


def gateway_command(creds: Path, listen: str, superlink: str) -> list[str]:
    """The Fleet gateway (``gateway``) as a process: ``python -m pflower.deploy gateway``."""
    return [
        sys.executable, "-m", "pflower.deploy", "gateway",
        "--listen", listen, "--superlink", superlink, "--credentials", str(creds),
    ]  # fmt: skip


_HOP_HEADERS = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
     "trailer", "upgrade", "proxy-connection", "content-encoding"}
)  # fmt: skip


def gateway(listen: str, superlink: str, creds: Path) -> None:
    """Serve Flower's Fleet API, and nothing else, on ``listen`` ("host:port", TLS with the
    SuperLink's certificate), forwarding each call to the SuperLink at ``superlink``
    (loopback, its certificate checked against ``ca.crt``).

    Why: Flower 1.41 serves the Control API (register keys, submit runs, whose app code then
    runs on every device), the Runtime API and the Fleet API on one port, and its open-source
    Control API has no account authentication. Devices must reach the Fleet API; nobody but
    the operator may reach the rest. Everything that is not a POST under ``/v1/fleet/`` is
    answered 403 and logged with the caller's address."""
    import ssl

    import httpx
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route

    upstream = httpx.AsyncClient(
        base_url=f"https://{superlink}",
        verify=ssl.create_default_context(cafile=str(creds / "ca.crt")),
        timeout=None,
    )

    async def forward(request):
        path, caller = request.url.path, request.client.host if request.client else "?"
        if request.method != "POST" or not path.startswith(FLEET_API):
            print(f"gateway: refused {request.method} {path} from {caller}", flush=True)
            return PlainTextResponse(
                "pflower gateway: only Flower's Fleet API is served on this address\n", 403
            )
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        try:
            reply = await upstream.post(
                path, content=await request.body(), headers=headers, params=request.query_params
            )
        except httpx.TransportError as err:  # the SuperLink is down: the node retries
            return PlainTextResponse(f"pflower gateway: SuperLink unreachable ({err})\n", 502)
        kept = {k: v for k, v in reply.headers.items() if k.lower() not in _HOP_HEADERS}
        return Response(reply.content, status_code=reply.status_code, headers=kept)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    app = Starlette(routes=[Route("/{path:path}", forward, methods=methods)])
    host, port = listen.rsplit(":", 1)
    print(f"gateway: Fleet API on {listen} -> SuperLink {superlink}", flush=True)
    uvicorn.run(
        app,
        host=host.strip("[]"),
        port=int(port),
        ssl_certfile=str(creds / "server.pem"),
        ssl_keyfile=str(creds / "server.key"),
        log_level="warning",
        access_log=False,
    )
