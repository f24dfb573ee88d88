"""The dashboard's thin shell: a read-only web app over a SwarmView, and the thread that feeds it.

Routes (all GET, nothing writes to the swarm):

| path                  | what                                                          |
|-----------------------|---------------------------------------------------------------|
| `/`                   | the page: swarm map, live charts, peer table, event log       |
| `/api/swarm`          | `SwarmView.snapshot()` as JSON                                |
| `/api/events`         | server-sent events: the snapshot again whenever it changes    |
| `/metrics`            | Prometheus text: peers per stage, served microbatches, steps  |
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
from fastapi.responses import FileResponse, HTMLResponse, Response, StreamingResponse
from hivemind.utils import get_dht_time
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from swarmtrain.errors import ConfigError, SwarmError
from swarmtrain.peers.dashboard.config import DashboardConfig
from swarmtrain.peers.dashboard.page import PAGE
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


class _SwarmCollector:
    """Prometheus collector that reads the view at scrape time (no state of its own)."""

    def __init__(self, view_provider: Callable[[], SwarmView]):
        self.view_provider = view_provider

    def collect(self):
        view = self.view_provider().snapshot()
        run = view["manifest"]["run_id"] if view["manifest"] else ""
        peers = GaugeMetricFamily(
            "swarmtrain_stage_peers", "Serving stage peers per stage", labels=["run", "stage"]
        )
        for s in view["stages"]:
            peers.add_metric([run, str(s["stage"])], s["num_serving"])
        served = GaugeMetricFamily(
            "swarmtrain_peer_served_microbatches",
            "Microbatches a peer has served since it started",
            labels=["run", "peer_id", "stage"],
        )
        peer_step = GaugeMetricFamily(
            "swarmtrain_peer_step",
            "Optimizer step a peer's parameters are at",
            labels=["run", "peer_id", "stage"],
        )
        for r in view["peers"]:
            if r["role"] == "stage":
                served.add_metric([run, r["peer_id"], str(r["stage"])], r["served"])
                peer_step.add_metric([run, r["peer_id"], str(r["stage"])], r["step"])
        step = GaugeMetricFamily(
            "swarmtrain_step", "Furthest optimizer step of any stage peer", labels=["run"]
        )
        step.add_metric([run], view["series"]["step"][-1] if view["series"]["step"] else 0)
        loss = GaugeMetricFamily(
            "swarmtrain_trainer_loss", "Last loss a trainer reported", labels=["run", "trainer"]
        )
        tokens = GaugeMetricFamily(
            "swarmtrain_trainer_tokens_per_second",
            "Last throughput a trainer reported",
            labels=["run", "trainer"],
        )
        for name, s in view["series"]["trainers"].items():
            if s["t"]:
                if s["loss"][-1] is not None:
                    loss.add_metric([run, name], s["loss"][-1])
                tokens.add_metric([run, name], s["tokens_per_s"][-1])
        yield from (peers, served, peer_step, step, loss, tokens)


def _sse(view: dict) -> str:
    return f"id: {view['version']}\ndata: {json.dumps(view, allow_nan=False)}\n\n"


def create_app(view_provider: Callable[[], SwarmView], *, stream_interval_s: float = 1.0) -> FastAPI:
    """The read-only dashboard app. `view_provider()` returns the SwarmView to show; it is
    called on every request, so the caller may swap views."""
    app = FastAPI(title="swarmtrain dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_SwarmCollector(view_provider))
    plotly_js = plotly_js_path()

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return PAGE

    @app.get("/static/plotly.min.js")
    def plotly() -> FileResponse:
        return FileResponse(plotly_js, media_type="application/javascript")

    @app.get("/api/swarm")
    def swarm() -> dict:
        return view_provider().snapshot()

    @app.get("/api/events")
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

    @app.get("/metrics")
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
        self._last_trainer_step: dict[str, int] = {}
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
            if point.step > self._last_trainer_step.get(point.trainer, -1):
                self._last_trainer_step[point.trainer] = point.step
                self.view.add_trainer_point(
                    point.step, point.loss, point.tokens_per_s, now=point.t, trainer=point.trainer
                )

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
