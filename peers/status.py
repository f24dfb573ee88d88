"""`swarmtrain status`: a run's stages, peers and trainers, read straight from the DHT.

No coordinator is needed: the reader joins the DHT as a client through any peer of the swarm
(a stage peer's address works as well as the coordinator's), reads `{run}.manifest`,
`{run}.peers` and `{run}.trainers` once and builds the picture the dashboard shows (a SwarmView
fed one poll), printed as rich tables or as JSON. An RL run gets a section of its own: its
rollout peers (policy version, lag behind the stages, sampling rate, quantization, bans) and
each trainer's last RL step (reward, accuracy, policy lag, samples/s, stale and rejected
completions).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from swarmtrain.errors import ConfigError
from swarmtrain.peers.dashboard.state import SwarmView
from swarmtrain.swarm.node import NodeConfig
from swarmtrain.wire.metrics import TrainerPoint
from swarmtrain.wire.records import CompressionConfig, PeerRecord, RunManifest, check_run_id

STATUS_STYLES = {
    "serving": "green",
    "joining": "yellow",
    "draining": "dark_orange",
    "lost": "magenta",
    "finished": "blue",
    "banned": "red",
    "gone": "dim",
}


@dataclass(frozen=True, kw_only=True)
class StatusConfig:
    """Which swarm to read and which of its runs to show."""

    node: NodeConfig
    """How to reach the swarm: `initial_peers` (any peer of it) is required; the node joins as a client."""
    run_id: str | None = None
    """Run to show; None: the only run the swarm announces."""

    def __post_init__(self):
        if not self.node.initial_peers:
            raise ConfigError("status needs --initial-peers: the address of any peer in the swarm")
        if self.run_id is not None:
            check_run_id(self.run_id)


class SwarmReader(Protocol):
    """What `read_status` needs of a node (a SwarmNode; tests pass a fake)."""

    def require_manifest(self, run_id: str | None) -> RunManifest: ...
    def get_manifest(self, run_id: str) -> RunManifest | None: ...
    def peers(self, run_id: str) -> list[PeerRecord]: ...
    def trainer_points(self, run_id: str) -> list[dict]: ...


def read_status(node: SwarmReader, run_id: str | None, *, now: float) -> dict:
    """The run's present state as JSON-ready primitives: `SwarmView.snapshot(with_history=False)`
    plus `run_id`. A run whose manifest has expired (its coordinators are gone) but whose peers
    still announce themselves is shown without block spans (`manifest` is null).

    Raises RunNotFoundError (listing the runs that exist) if the swarm has no such run.
    """
    if run_id is None:
        manifest = node.require_manifest(None)
        run_id = manifest.run_id
    else:
        manifest = node.get_manifest(run_id)
    records = node.peers(run_id)
    if manifest is None and not records:
        manifest = node.require_manifest(run_id)  # raises, naming the runs there are
    view = SwarmView()
    view.update(records, manifest, now)
    for raw in node.trainer_points(run_id):
        try:
            view.add_trainer_point(TrainerPoint.from_dict(raw))
        except ConfigError:
            continue  # a malformed point is another peer's bug, not a reason to show nothing
    return {
        "run_id": run_id,
        "rl_plan": rl_plan(manifest, records),
    } | view.snapshot(with_history=False)


def rl_plan(manifest: RunManifest | None, records: list[PeerRecord]) -> dict | None:
    """What the joint planner sees of an RL run (`swarmtrain.plan.rl`): the samples/s its stages
    can train on and its rollout peers can sample, from their announced capacities, and how
    many peers follow it (`--role auto`); None for other runs, or when it cannot tell."""
    if manifest is None or manifest.rl is None:
        return None
    from swarmtrain.plan.rl import rl_rates
    from swarmtrain.rl.roles import RoleView, rl_demand
    from swarmtrain.train.placement import manifest_costs, manifest_plan_config

    try:
        view = RoleView(manifest, records)
        consumed, produced = rl_rates(
            view.plan,
            view.rollouts,
            manifest_costs(manifest),
            view.peers,
            manifest_plan_config(manifest),
            rl_demand(manifest),
        )
    except ConfigError:  # a task this reader may not build, a capacity that does not add up
        return None
    return {
        "consumed_samples_per_s": consumed,
        "produced_samples_per_s": produced,
        "auto_peers": len(view.movable),
    }


def read_swarm_status(config: StatusConfig) -> dict:
    """Join the swarm as a DHT client, read the run's status, leave. SwarmError if the swarm
    cannot be reached, RunNotFoundError if it has no such run."""
    from hivemind.utils import get_dht_time

    from swarmtrain.swarm.node import SwarmNode

    node = SwarmNode(config.node)
    try:
        return read_status(node, config.run_id, now=get_dht_time())
    finally:
        node.shutdown()


# rendering


def format_bytes(n: float | None) -> str:
    if not n:
        return "0" if n == 0 else ""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_seconds(s: float) -> str:
    if not s:
        return ""
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def format_age(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h"


def _status_text(status: str) -> Text:
    return Text(status, style=STATUS_STYLES.get(status, ""))


def _device(r: dict) -> str:
    name = r["capacity"].get("device_name")
    device = f"cpu ({name})" if name and r["device"] == "cpu" else r["device"]
    return f"{device} ({r['quantize']})" if r.get("quantize") else device


def _memory(r: dict) -> str:
    used, total = r["memory_used_bytes"], r["memory_total_bytes"]
    if not used and not total:
        return ""
    return f"{format_bytes(used)} / {format_bytes(total) if total else '?'}"


def stages_table(status: dict) -> Table:
    table = _table("stages", ("stage", "blocks", "serving", "replicas"), ("blocks", "replicas"))
    for s in status["stages"]:
        replicas = Text("\n").join(
            Text.assemble(r["peer_id"][-8:], " ", _status_text(r["status"]), f" {_device(r)}")
            for r in s["replicas"]
        )
        start, end = s["blocks"]
        table.add_row(
            str(s["stage"]), f"{start}-{end - 1}", str(s["num_serving"]), replicas or Text("none", "red")
        )
    return table


def _table(title: str, columns: tuple[str, ...], left: tuple[str, ...]) -> Table:
    table = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True
    )
    for name in columns:
        table.add_column(name, justify="left" if name in left else "right", no_wrap=name != "device")
    return table


def peers_table(status: dict, now: float) -> Table:
    """Who is in the swarm: role, stage, state, device, memory, step, the newest checkpoint it
    holds and uptime, gone peers last."""
    columns = ("peer", "role", "stage", "state", "device", "memory", "step", "ckpt", "up")
    table = _table("peers", columns, ("peer", "role", "state", "device"))
    for r in status["peers"] + status["gone"]:
        stage = r["role"] == "stage"
        table.add_row(
            r["peer_id"][-8:],
            r["role"],
            str(r["stage"]) if stage else "",
            _status_text(r["status"]),
            _device(r),
            _memory(r),
            str(r["step"]) if stage or r["role"] == "rollout" else "",  # a rollout peer's: its policy version
            str(max(r["checkpoints"])) if r.get("checkpoints") else "",  # the newest checkpoint it holds
            "gone" if r["status"] == "gone" else format_age(now - r["since"]) if r["since"] else "",
        )
    return table


def work_table(status: dict) -> Table:
    """What the stage peers do: queue, service time, microbatches and bytes on the wire."""
    columns = ("peer", "queue", "service", "served", "replays", "fails", "sent", "recv", "compr.")
    table = _table("stage peers at work", columns, ("peer",))
    for r in status["peers"] + status["gone"]:
        if r["role"] != "stage":
            continue
        table.add_row(
            Text(r["peer_id"][-8:], style=STATUS_STYLES["gone"] if r["status"] == "gone" else ""),
            str(r["queue_depth"]),
            format_seconds(r["service_s"]),
            str(r["served"]),
            str(r["replayed"]),
            str(r["failed"]),
            format_bytes(r["bytes_sent"]),
            format_bytes(r["bytes_received"]),
            f"{r['compression']:.2f}x" if r["compression"] else "",
        )
    return table


def rollout_table(status: dict) -> Table | None:
    """What the rollout peers do (an RL run's): their state (banned: a trainer banned them),
    the policy version each samples with and its lag behind the stages', the completions it
    sent, its sampling rate, its quantization, requests it refused and update bytes taken."""
    rows = [r for r in status["peers"] + status["gone"] if r["role"] == "rollout"]
    if not rows:
        return None
    columns = ("peer", "state", "quant", "version", "lag", "samples", "samples/s", "refused", "updates recv")
    table = _table("rollout peers", columns, ("peer", "state", "quant"))
    for r in rows:
        table.add_row(
            r["peer_id"][-8:],
            _status_text(r["status"]),
            r["quantize"] or "",
            str(r["step"]),
            "" if r["policy_lag"] is None else str(r["policy_lag"]),
            str(r["served"]),
            f"{1 / r['service_s']:.1f}" if r["service_s"] else "",
            str(r["failed"]),
            format_bytes(r["bytes_received"]),
        )
    return table


def _mean(x: float | None, digits: int) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def rl_trainers_table(status: dict) -> Table | None:
    """What each trainer's last RL step trained on, and what its feed counted so far."""
    points = [p for p in status["trainers"] if p.get("rl")]
    if not points:
        return None
    columns = (
        "trainer",
        "step",
        "reward",
        "accuracy",
        "policy lag",
        "samples/s",
        "stale",
        "rejected",
        "lost",
        "banned",
    )
    table = _table("RL steps (the last step each trainer reported)", columns, ("trainer",))
    for p in points:
        rl = p["rl"]
        table.add_row(
            p["trainer"][-8:],
            str(p["step"]),
            _mean(rl["reward"], 3),
            _mean(rl["accuracy"], 3),
            _mean(rl["policy_lag"], 2),
            f"{rl['samples_per_s']:.1f}",
            str(rl["stale"]),
            str(rl["rejected"]),
            str(rl["lost"]),
            Text(str(rl["banned"]), style="red" if rl["banned"] else ""),
        )
    return table


def rl_section(status: dict) -> list:
    """An RL run's part of the status: a headline (task, groups, staleness, the stages' policy
    version), its rollout peers and its trainers' RL steps."""
    rl = (status["manifest"] or {}).get("rl")
    what = (
        f"RL: task {rl['task']}, {rl['samples_per_prompt']} samples a prompt, max staleness {rl['max_staleness']}"
        if rl
        else "RL"
    )
    version = status["rl"]["policy_version"]
    parts = [Text(what + ("" if version is None else f"; the stages serve policy version {version}"))]
    plan = status.get("rl_plan")
    if plan:
        parts.append(
            Text(
                f"planner: the stages can train ~{plan['consumed_samples_per_s']:.0f} samples/s, the rollout peers "
                f"sample ~{plan['produced_samples_per_s']:.0f} (from their probes); {plan['auto_peers']} "
                f"peer{'s' if plan['auto_peers'] != 1 else ''} follow it (--role auto)"
            )
        )
    for table in (rollout_table(status), rl_trainers_table(status)):
        if table is not None:
            parts.append(table)
    if len(parts) == 1:
        parts.append(Text("no rollout peer announced, no RL step reported"))
    return parts


def trainers_table(status: dict, now: float) -> Table:
    columns = ("trainer", "step", "loss", "tokens/s", "done", "replayed", "dropped", "window", "age")
    table = _table("trainers (the last step each reported)", columns, ("trainer",))
    for p in status["trainers"]:
        table.add_row(
            p["trainer"][-8:],
            str(p["step"]),
            "n/a" if p["loss"] is None else f"{p['loss']:.3f}",
            f"{p['tokens_per_s']:.0f}",
            str(p["completed"]),
            str(p["replayed"]),
            str(p["dropped"]),
            str(p["window"]),
            format_age(max(0.0, now - p["t"])),
        )
    return table


def prediction_line(status: dict) -> Text | None:
    """The cost model's tokens/s for the live layout beside what the trainers measured."""
    p = status.get("prediction")
    if not p:
        return None
    measured = max((t["tokens_per_s"] for t in status["trainers"]), default=None)
    text = (
        f"layout: the cost model predicts {p['predicted_tokens_per_s']:.0f} tokens/s (of {p['stage_peers']} "
        f"stage peers, {p['measured_peers']} at their measured seconds per microbatch, "
        f"{p['calibrated_peers']} timed a block of the run's model at join)"
    )
    if measured:
        text += f"; the trainers measure {measured:.0f} ({p['predicted_tokens_per_s'] / measured:.2f}x)"
    replan = status.get("replan")
    if replan:
        text += "\n" + replan_text(replan)
    return Text(text)


def replan_text(replan: dict) -> str:
    """One line on the layout the planner would give the serving peers now (`LayoutWatch`)."""
    from swarmtrain.wire.layout_record import spans_text

    spans = spans_text(replan["stage_bounds"])
    gain = replan["gain"]
    gain_text = "from a stalled layout" if gain is None else f"{gain:+.0%}"
    held = (
        f"held {replan['streak']} of {replan['patience']} polls"
        if replan["streak"]
        else "under the move threshold"
    )
    return (
        f"re-plan: these peers would get blocks {spans} ({len(replan['assignments'])} serving), "
        f"{replan['planned_tokens_per_s']:.0f} tokens/s predicted ({gain_text}, {held}); "
        "a run with --replan moves to such a layout once it holds"
    )


def render_status(status: dict) -> Group:
    """`read_status`'s result as rich renderables: a headline, then stages, peers and trainers
    (and an RL run's section)."""
    now = status["updated_at"] or time.time()
    m = status["manifest"]
    step = max((r["step"] for r in status["peers"] if r["role"] == "stage"), default=0)
    if m is None:
        headline = Text(
            f"run {status['run_id']!r}: no manifest in the DHT (no coordinator has republished it lately); "
            "peers as they announce themselves:"
        )
    else:
        headline = Text(
            f"run {m['run_id']!r}: {m['model']}, {m['num_blocks']} blocks in {m['num_stages']} stages "
            f"{m['stage_bounds']}, schedule {m['schedule']}{', loss ' + m['loss'] if m.get('loss') else ''}, step {step}"
            + (f" of {m['max_steps']}" if m["max_steps"] else "")
            + (" (finished)" if status["finished"] else "")
        )
        if m.get("layout_version") == 0:
            headline.append(f"\nlayout {m['layout_note']}")
        elif m.get("layout_note"):
            when = (
                f" (planned {format_age(max(0.0, now - m['layout_at']))} ago)" if m.get("layout_at") else ""
            )
            headline.append(f"\nlayout {m['layout_version']}{when}: {m['layout_note']}")
        if m["compressed"]:
            headline.append(f"\ncompression: {CompressionConfig.from_dict(m['compression']).describe()}")
    parts = [headline]
    if m is not None:
        parts.append(stages_table(status))
    if status["peers"] or status["gone"]:
        parts.append(peers_table(status, now))
        if any(r["role"] == "stage" for r in status["peers"] + status["gone"]):
            parts.append(work_table(status))
    else:
        parts.append(Text("no peers announced"))
    parts.append(
        trainers_table(status, now) if status["trainers"] else Text("no trainer has reported a step")
    )
    line = prediction_line(status)
    if line is not None:
        parts.append(line)
    if status["rl"] is not None:
        parts += rl_section(status)
    return Group(*parts)
