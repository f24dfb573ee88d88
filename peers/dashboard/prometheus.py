"""Prometheus metrics of a swarm, read from a SwarmView at scrape time.

Gauges for what goes up and down (peers per stage, queue depth, service time, memory), and
counters for what only grows while a peer lives (microbatches replayed, requests failed,
bytes sent and received); every per-peer series is labelled with run, peer_id and stage.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from swarmtrain.peers.dashboard.state import SwarmView

PEER_LABELS = ["run", "peer_id", "stage"]
TRAINER_LABELS = ["run", "trainer"]

PEER_GAUGES = {
    # metric name: (record field, help)
    "swarmtrain_peer_served_microbatches": ("served", "Microbatches a peer has served since it started"),
    "swarmtrain_peer_step": ("step", "Optimizer step a peer's parameters are at"),
    "swarmtrain_peer_queue_depth": ("queue_depth", "Compute tasks waiting or running on a peer"),
    "swarmtrain_peer_backlog_seconds": ("backlog_s", "Expected seconds of compute queued on a peer"),
    "swarmtrain_peer_service_seconds": (
        "service_s",
        "Moving average of the compute seconds one microbatch costs a peer",
    ),
    "swarmtrain_peer_holding_microbatches": ("holding", "Microbatches whose activations a peer holds"),
    "swarmtrain_peer_in_flight_budget": (
        "in_flight_budget",
        "Microbatches a peer may hold at once (0: unknown)",
    ),
    "swarmtrain_peer_memory_used_bytes": ("memory_used_bytes", "Memory a peer's compute uses now"),
    "swarmtrain_peer_banned_peers": ("banned", "Peers this peer bans now"),
}
PEER_COUNTERS = {
    # metric name without `_total`: (record field, help)
    "swarmtrain_peer_replayed_microbatches": ("replayed", "Microbatches a peer re-sent after a failure"),
    "swarmtrain_peer_failed_requests": ("failed", "Requests a peer answered with an error"),
    "swarmtrain_peer_sent_bytes": ("bytes_sent", "Tensor bytes a peer sent, as on the wire"),
    "swarmtrain_peer_received_bytes": ("bytes_received", "Tensor bytes a peer received, as on the wire"),
    "swarmtrain_peer_raw_sent_bytes": ("raw_bytes_sent", "Tensor bytes a peer sent, before compression"),
    "swarmtrain_peer_busy_seconds": ("busy_s", "Seconds of compute since a peer started"),
}
TRAINER_COUNTERS = {
    "swarmtrain_trainer_completed_microbatches": (
        "completed",
        "Microbatches whose gradients went into a step",
    ),
    "swarmtrain_trainer_replayed_microbatches": ("replayed", "Microbatch replays after a failure"),
    "swarmtrain_trainer_dropped_microbatches": ("dropped", "Microbatches left out of their step"),
}


def _value(record: dict, field: str) -> float:
    value = record[field]
    return float(len(value)) if isinstance(value, list) else float(value)


class SwarmCollector:
    """Prometheus collector over the view `view_provider()` returns (no state of its own)."""

    def __init__(self, view_provider: Callable[[], SwarmView]):
        self.view_provider = view_provider

    def collect(self):
        view = self.view_provider().snapshot()
        run = view["manifest"]["run_id"] if view["manifest"] else ""
        stage_peers = GaugeMetricFamily(
            "swarmtrain_stage_peers", "Serving stage peers per stage", labels=["run", "stage"]
        )
        for s in view["stages"]:
            stage_peers.add_metric([run, str(s["stage"])], s["num_serving"])
        yield stage_peers
        step = GaugeMetricFamily(
            "swarmtrain_step", "Furthest optimizer step of any stage peer", labels=["run"]
        )
        step.add_metric([run], view["series"]["step"][-1] if view["series"]["step"] else 0)
        yield step
        banned = GaugeMetricFamily(
            "swarmtrain_peer_banned", "1 while another live peer bans this peer", labels=PEER_LABELS
        )
        peers = [r for r in view["peers"] if r["role"] == "stage"]
        families = [
            GaugeMetricFamily(name, text, labels=PEER_LABELS) for name, (_, text) in PEER_GAUGES.items()
        ]
        families += [
            CounterMetricFamily(name, text, labels=PEER_LABELS) for name, (_, text) in PEER_COUNTERS.items()
        ]
        fields = [field for field, _ in PEER_GAUGES.values()] + [field for field, _ in PEER_COUNTERS.values()]
        for r in peers:
            labels = [run, r["peer_id"], str(r["stage"])]
            for family, field in zip(families, fields):
                family.add_metric(labels, _value(r, field))
            banned.add_metric(labels, float(r["status"] == "banned"))
        yield from families
        yield banned
        yield from self._trainer_metrics(run, view["trainers"])

    @staticmethod
    def _trainer_metrics(run: str, trainers: list[dict]):
        loss = GaugeMetricFamily(
            "swarmtrain_trainer_loss", "Last loss a trainer reported", labels=TRAINER_LABELS
        )
        tokens = GaugeMetricFamily(
            "swarmtrain_trainer_tokens_per_second",
            "Last throughput a trainer reported",
            labels=TRAINER_LABELS,
        )
        window = GaugeMetricFamily(
            "swarmtrain_trainer_window_microbatches",
            "Microbatches a trainer keeps in flight",
            labels=TRAINER_LABELS,
        )
        counters = [
            CounterMetricFamily(name, text, labels=TRAINER_LABELS)
            for name, (_, text) in TRAINER_COUNTERS.items()
        ]
        for p in trainers:
            labels = [run, p["trainer"]]
            if p["loss"] is not None:
                loss.add_metric(labels, p["loss"])
            tokens.add_metric(labels, p["tokens_per_s"])
            window.add_metric(labels, p["window"])
            for family, (field, _) in zip(counters, TRAINER_COUNTERS.values()):
                family.add_metric(labels, p[field])
        yield from (loss, tokens, window, *counters)
