"""The dashboard's thin shell: a read-only web app over a SwarmView, and the thread that feeds it.

Routes (all GET, nothing writes to the swarm):

| path                  | what                                                          |
|-----------------------|---------------------------------------------------------------|
| `/`                   | the page: swarm map, live charts, peer table, event log       |
| `/api/swarm`          | `SwarmView.snapshot()` as JSON (model: api.SwarmSnapshot)     |
| `/api/events`         | server-sent events: the snapshot again whenever it changes    |
| `/metrics`            | Prometheus text (see prometheus.py): per stage, peer, trainer |
| `/openapi.json`       | the API's OpenAPI schema                                      |
| `/static/plotly.min.js` | plotly.js from the `plotly` package (no CDN, works offline) |
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from hivemind.utils import get_dht_time
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

import swarmtrain
from swarmtrain.errors import ConfigError, SwarmError
from swarmtrain.peers.dashboard.api import SwarmSnapshot
from swarmtrain.peers.dashboard.config import DashboardConfig
from swarmtrain.peers.dashboard.page import PAGE
from swarmtrain.peers.dashboard.prometheus import PEER_COUNTERS, PEER_GAUGES, SwarmCollector
from swarmtrain.peers.dashboard.state import SwarmView
from swarmtrain.swarm import SwarmNode
from swarmtrain.wire.metrics import TrainerPoint

__all__ = ["DashboardConfig", "DashboardThread", "create_app"]

logger = logging.getLogger(__name__)


def plotly_js_path() -> Path:
    """plotly.min.js as the `plotly` pip package ships it (found without importing plotly)."""
    spec = importlib.util.find_spec("plotly")
    path = Path(spec.origin).parent / "package_data" / "plotly.min.js" if spec and spec.origin else None
    if path is None or not path.is_file():
        raise SwarmError("the dashboard needs plotly.js: install the `plotly` package (pip install plotly)")
    return path


def _sse(view: dict) -> str:
    return f"id: {view['version']}\ndata: {json.dumps(view, allow_nan=False)}\n\n"


def create_app(view_provider: Callable[[], SwarmView], *, stream_interval_s: float = 1.0) -> FastAPI:
    """The read-only dashboard app. `view_provider()` returns the SwarmView to show; it is
    called on every request, so the caller may swap views."""
    app = FastAPI(
        title="swarmtrain dashboard",
        description="Read-only view of one swarmtrain run, built from its DHT records. Nothing here "
        "writes to the swarm.",
        version=swarmtrain.__version__,
        docs_url=None,  # the Swagger and ReDoc pages load their scripts from a CDN; /openapi.json is enough
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SwarmCollector(view_provider))
    plotly_js = plotly_js_path()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page() -> str:
        return PAGE

    @app.get("/static/plotly.min.js", include_in_schema=False)
    def plotly() -> FileResponse:
        return FileResponse(plotly_js, media_type="application/javascript")

    @app.get(
        "/api/swarm",
        response_model=SwarmSnapshot,
        summary="The swarm now and its recent history",
        description="Run manifest, swarm map (stages, block spans, replicas and their states), peers "
        "with their counters, trainers' latest points, bounded time series and the event log.",
    )
    def swarm() -> JSONResponse:
        return JSONResponse(view_provider().snapshot())  # the model documents it; tests hold them equal

    @app.get(
        "/api/events",
        response_class=StreamingResponse,
        summary="Live updates (server-sent events)",
        description="A text/event-stream: a `data:` message with the same JSON as /api/swarm whenever "
        f"the view changed, checked every {stream_interval_s:g} s, and a comment line otherwise.",
        responses={
            200: {
                "content": {"text/event-stream": {"schema": {"$ref": "#/components/schemas/SwarmSnapshot"}}}
            }
        },
    )
    async def events(request: Request) -> StreamingResponse:
        async def stream():
            yield f"retry: {int(stream_interval_s * 1000)}\n\n"
            last = None
            while not await request.is_disconnected():
                view = view_provider()
                if view.version != last:
                    snapshot = view.snapshot()
                    last = snapshot["version"]
                    yield _sse(snapshot)
                else:
                    yield ": unchanged\n\n"  # a comment line keeps proxies from timing the stream out
                await asyncio.sleep(stream_interval_s)

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        summary="Prometheus metrics",
        description="Prometheus text format. Per stage: swarmtrain_stage_peers. Per peer (labels run, "
        "peer_id, stage): "
        + ", ".join([*PEER_GAUGES, *(f"{name}_total" for name in PEER_COUNTERS)])
        + ", swarmtrain_peer_banned. Per trainer: loss, tokens/s, window and microbatch counters.",
    )
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


class DashboardThread:
    """Serve the dashboard of `run_id` from background threads until `stop()`.

    The port is bound in the constructor (SwarmError if it is taken), so `url` answers as soon
    as the constructor returns. One thread runs uvicorn, another polls `node` every `poll_s`;
    a failed DHT read is logged and skipped, never fatal. The node stays the caller's.
    """

    def __init__(self, node: SwarmNode, run_id: str, config: DashboardConfig | None = None):
        self.node = node
        self.run_id = run_id
        self.config = config or DashboardConfig()
        self.view = SwarmView(self.config.view)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((self.config.host, self.config.port))
        except OSError as e:
            self._sock.close()
            raise SwarmError(
                f"the dashboard cannot listen on {self.config.host}:{self.config.port} ({e.strerror}): "
                "pick another --dashboard-port, or 0 for any free port"
            ) from None
        self._sock.listen(64)  # connections made before uvicorn starts wait in the backlog
        self.port = self._sock.getsockname()[1]
        app = create_app(lambda: self.view, stream_interval_s=self.config.poll_s)
        server_config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(server_config)
        self._stopped = threading.Event()
        self._serve_thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="dashboard-http", daemon=True
        )
        self._poll_thread = threading.Thread(target=self._poll, name="dashboard-poll", daemon=True)
        self._serve_thread.start()
        self._poll_thread.start()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host == "0.0.0.0" else self.config.host
        return f"http://{host}:{self.port}"

    def poll_once(self) -> None:
        """Read the run's records from the DHT into the view (the poll thread calls this)."""
        try:
            manifest = self.node.get_manifest(self.run_id)
        except ConfigError as e:
            logger.warning("dashboard: ignoring a malformed manifest of run %s: %s", self.run_id, e)
            manifest = None
        records = self.node.peers(self.run_id)
        now = get_dht_time()
        self.view.update(records, manifest, now)
        for raw in self.node.trainer_points(self.run_id):
            try:
                point = TrainerPoint.from_dict(raw)
            except ConfigError as e:
                logger.debug("dashboard: ignoring a malformed trainer point: %s", e)
                continue
            self.view.add_trainer_point(point)  # the view skips a point it has seen

    def _poll(self) -> None:
        while not self._stopped.is_set():
            started = time.monotonic()
            try:
                self.poll_once()
            except Exception as e:  # a DHT hiccup must not end the dashboard
                logger.warning("dashboard: reading the DHT failed: %r", e)
            self._stopped.wait(max(0.0, self.config.poll_s - (time.monotonic() - started)))

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and polling; returns once both threads ended (or `timeout_s` passed)."""
        self._stopped.set()
        self._server.should_exit = True
        self._serve_thread.join(timeout_s)
        self._poll_thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> DashboardThread:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
