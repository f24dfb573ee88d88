"""The swarm dashboard: a read-only web view of one run's DHT records.

`state` is the pure aggregator (no I/O, unit-tested with plain records); `server` is the
shell around it (FastAPI app, uvicorn thread, DHT poller).
"""

from __future__ import annotations

import importlib.util

MISSING_EXTRA = "the dashboard needs the [dashboard] extra: pip install 'swarmtrain[dashboard]'"
"""What to tell a user whose install lacks the dashboard's packages."""


def dashboard_available() -> bool:
    """Whether the dashboard's packages (the [dashboard] extra) are installed."""
    return all(importlib.util.find_spec(m) is not None for m in ("fastapi", "uvicorn", "prometheus_client"))
