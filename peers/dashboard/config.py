"""The dashboard's config, importable without the web stack (fastapi, uvicorn) installed."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmtrain.errors import ConfigError
from swarmtrain.peers.dashboard.state import ViewConfig
from swarmtrain.swarm.node import check_host


@dataclass(frozen=True, kw_only=True)
class DashboardConfig:
    """Where the dashboard listens and how often it reads the DHT."""

    host: str = "127.0.0.1"
    """Address to listen on; 127.0.0.1 keeps the page on this machine (0.0.0.0 shows it to the network)."""
    port: int = 0
    """TCP port; 0 picks a free one (see `DashboardThread.url`)."""
    poll_s: float = 1.0
    """Seconds between reads of the run's DHT records."""
    view: ViewConfig = field(default_factory=ViewConfig)

    def __post_init__(self):
        check_host(self.host, "--dashboard-host")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--dashboard-port must be in 0..65535 (0 picks a free port), got {self.port}")
        if not self.poll_s > 0:
            raise ConfigError(f"dashboard poll_s must be > 0, got {self.poll_s}")
