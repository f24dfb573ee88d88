"""The swarm dashboard: a read-only web view of one run's DHT records.

`state` is the pure aggregator (no I/O, unit-tested with plain records); `server` is the
shell around it (FastAPI app, uvicorn thread, DHT poller).
"""
