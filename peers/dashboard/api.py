"""The JSON API's response models: what `/api/swarm` (and each `/api/events` message) holds.

They document the API in `/openapi.json`. The routes return `SwarmView.snapshot()` as it is,
without validating it per request; the tests validate snapshots against these models, so the
two cannot drift apart.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ManifestSummary(BaseModel):
    """The run's manifest, as the coordinator published it."""

    model_config = ConfigDict(populate_by_name=True)

    run_id: str
    model: str = Field(description="Model builder: a registered name or 'package.module:function'.")
    builder_options: dict = Field(alias="model_config", description="Keyword arguments of the builder.")
    num_blocks: int
    num_stages: int
    stage_bounds: list[int] = Field(description="Stage k holds blocks [b[k], b[k+1]).")
    layout_version: int = Field(
        description="Version of the run's layout (0: pending, the stages are planned once peers come)."
    )
    layout_note: str = Field(description="Why the layout is what it is ('' for one set with the run).")
    layout_at: float = Field(description="DHT time the layout was planned (0: set with the run).")
    batch: dict
    optimizer: dict
    max_steps: int = Field(description="Steps the run aims for (0: until stopped).")
    schedule: str = Field(description="'readiness' or 'static'.")
    loss: str | None = Field(
        description="The registered loss the last stage computes (None: the model's own)."
    )
    compression: dict = Field(
        description="Codecs per direction: one for the whole pipeline or a comma-separated list per boundary "
        "(activations, gradients) or per stage (averaging); and error_feedback."
    )
    compressed: bool = Field(description="Whether any direction compresses anywhere.")
    rl: dict | None = Field(
        description="An RL run's task and sampling (task, samples_per_prompt, max_staleness, ...); null: not an RL run."
    )


class PeerView(BaseModel):
    """A peer's latest record (every field of `PeerRecord`) plus what the dashboard derives."""

    model_config = ConfigDict(extra="allow")

    peer_id: str
    role: str = Field(
        description="coordinator, stage, trainer or rollout (an RL run's: its step is the policy version it samples with, served the completions it sent)."
    )
    stage: int = Field(description="Stage served; -1 for other roles.")
    state: str = Field(description="What the peer says: joining, serving, draining, lost or finished.")
    status: str = Field(
        description="What the map shows: joining, serving, draining, lost, finished, banned or gone."
    )
    device: str
    version: str = Field(description="swarmtrain version of the peer.")
    since: float = Field(description="DHT time the peer started serving its stage.")
    capacity: dict = Field(
        description="What the peer's probe measured: flops_per_s, memory_bytes, device_name..."
    )
    served: int = Field(description="Microbatches served (forward and backward).")
    step: int
    queue_depth: int = Field(description="Compute tasks waiting or running on the peer.")
    backlog_s: float = Field(description="Expected seconds of compute queued on the peer.")
    service_s: float = Field(description="Moving average of the compute seconds one microbatch costs.")
    in_flight_budget: int = Field(description="Microbatches the peer may hold at once (0: unknown).")
    holding: int = Field(description="Microbatches whose activations the peer holds now.")
    busy_s: float = Field(description="Seconds of compute since the peer started.")
    exchange_s: float = Field(
        description="Moving average of the seconds a step's gradient exchange with its stage's other replicas "
        "takes the peer (what the planner charges replicas per step); 0 if it never exchanged."
    )
    memory_used_bytes: int
    memory_total_bytes: int | None = Field(description="capacity.memory_bytes; null when unknown.")
    replayed: int
    failed: int
    banned: list[str] = Field(description="Peers this peer bans now.")
    banned_by: list[str] = Field(description="Live peers that ban this one now.")
    bytes_sent: int
    bytes_received: int
    raw_bytes_sent: int
    checkpoints: list[int] = Field(description="Steps of the checkpoints of its stage the peer holds.")
    layout: int = Field(description="Stage peers: the layout version whose stage they serve.")
    quantize: str | None = Field(
        description="Rollout peers: '8bit' or '4bit' when their policy copies are quantized; null: full precision."
    )
    policy_lag: int | None = Field(
        description="Rollout peers: policy versions behind the newest a live stage peer holds; null for other roles."
    )
    compression: float | None = Field(description="raw_bytes_sent / bytes_sent; null before any bytes.")
    served_per_s: float
    bytes_sent_per_s: float
    missing_polls: int = Field(description="Consecutive polls the record was missing from (>0: stale).")
    left_at: float | None = Field(description="When a gone peer was seen leaving; null for live peers.")


class StageView(BaseModel):
    """One column of the swarm map."""

    stage: int
    blocks: list[int] = Field(description="[start, end): the blocks the stage holds.")
    num_serving: int
    codecs: dict[str, str | None] = Field(
        description="What this stage's peers send with: 'forward' (activations to the next stage), 'backward' "
        "(gradients to the previous one), 'averaging' (to the other replicas); null where it sends none of it."
    )
    replicas: list[PeerView] = Field(description="Live replicas (earliest first), then recently gone ones.")


class RLView(BaseModel):
    """An RL run's step as its trainer saw it (`RLPoint`); the means are null for a step of no samples."""

    samples: int = Field(description="Completions the trainer fed into the step.")
    reward: float | None = Field(description="Their mean reward.")
    accuracy: float | None = Field(description="The fraction fully right.")
    policy_lag: float | None = Field(
        description="Their mean policy lag: the step minus the sampling version."
    )
    samples_per_s: float = Field(description="Completions fed into the step per second of it.")
    stale: int = Field(description="Completions dropped as too stale, since the trainer's feed started.")
    rejected: int = Field(description="Completions refused with their rollout peer, since then.")
    lost: int = Field(description="Completions asked of a rollout peer that failed before answering.")
    banned: int = Field(description="Rollout peers banned from the run.")
    verified: int = Field(
        description="Replies whose behaviour log-probs the pipeline checked and found to hold."
    )
    verify_failed: int = Field(description="Replies whose behaviour log-probs did not hold.")


class RLSummary(BaseModel):
    """An RL run at a glance: the newest RL step of each trainer, put together."""

    policy_version: int | None = Field(
        description="The newest policy version (step) a live stage peer holds."
    )
    rollout_peers: int = Field(description="Serving rollout peers that no peer bans.")
    step: int | None = Field(description="The newest step a trainer reported RL figures of.")
    reward: float | None = Field(
        description="Mean reward over the completions the trainers' latest steps trained on."
    )
    accuracy: float | None = Field(description="The fraction of them fully right.")
    policy_lag: float | None = Field(description="Their mean policy lag (steps).")
    samples_per_s: float = Field(description="The trainers' samples/s, summed.")
    stale: int = Field(description="Completions dropped as too stale, summed over the trainers' feeds.")
    rejected: int = Field(description="Completions refused with their rollout peer, summed likewise.")
    banned: int = Field(description="The most rollout peers any trainer banned.")


class TrainerView(BaseModel):
    """A trainer's latest point (`TrainerPoint`); loss is null when it was not finite."""

    trainer: str
    step: int
    loss: float | None
    tokens_per_s: float
    t: float
    completed: int
    replayed: int
    dropped: int
    window: int
    rolled_back: str
    rl: RLView | None = Field(
        description="An RL run's step: rewards, policy lag, feed counts; null otherwise."
    )


class EventView(BaseModel):
    t: float
    kind: str = Field(description="join, leave, state, move, ban, replay, drop, rollback or step.")
    peer_id: str
    text: str


class PeerSeries(BaseModel):
    t: list[float]
    role: str = Field(
        description="'stage' (served: microbatches) or 'rollout' (served: completions sampled)."
    )
    served: list[int]
    served_per_s: list[float]
    bytes_sent_per_s: list[float]
    step: list[int]


class TrainerSeries(BaseModel):
    t: list[float]
    step: list[int]
    loss: list[float | None]
    tokens_per_s: list[float]
    completed: list[int]
    replayed: list[int]
    dropped: list[int]
    window: list[int]
    reward: list[float | None] = Field(description="RL runs; null at a point without RL figures.")
    accuracy: list[float | None]
    policy_lag: list[float | None]
    samples_per_s: list[float | None]
    stale: list[int | None]
    rejected: list[int | None]


class LayoutPrediction(BaseModel):
    """The planner's cost model on the live layout (`placement.layout_prediction`)."""

    predicted_tokens_per_s: float = Field(
        description="Tokens/s the cost model predicts for a step: the pipeline filling and draining "
        "around the step's microbatches (GPipe's bubble)."
    )
    steady_tokens_per_s: float = Field(description="The pipeline's rate with every stage busy.")
    measured_peers: int = Field(
        description="Serving stage peers counted at their measured compute seconds per microbatch."
    )
    calibrated_peers: int = Field(
        description="Serving stage peers that announced a rate timed on a block of the run's model; "
        "the others count at their matmul probe's rate."
    )
    stage_peers: int = Field(description="Serving stage peers in the layout.")


class LayoutReplan(BaseModel):
    """The layout the planner would give the serving peers now, against theirs."""

    stage_bounds: list[int]
    assignments: dict[str, int] = Field(description="Stage of each peer the proposal gives one.")
    current_tokens_per_s: float = Field(description="Predicted tokens/s of the live layout.")
    planned_tokens_per_s: float = Field(description="Predicted tokens/s of the proposal.")
    gain: float | None = Field(description="planned / current - 1 (null from a stalled layout).")
    streak: int = Field(description="Polls in a row the proposal has cleared min_gain.")
    patience: int = Field(description="Polls in a row a move would need.")
    min_gain: float
    sustained: bool = Field(description="The gain has held for `patience` polls.")


class SeriesView(BaseModel):
    """Bounded time series; the swarm-level lists are aligned with `t`."""

    t: list[float]
    peers_per_stage: list[list[int]]
    step: list[int]
    bytes_sent_per_s: list[float] = Field(description="Sum of the stage peers' bytes_sent rates.")
    raw_bytes_sent_per_s: list[float]
    predicted_tokens_per_s: list[float | None] = Field(
        description="The cost model's tokens/s for the live layout at each poll; null while a stage "
        "has no serving replica."
    )
    peers: dict[str, PeerSeries]
    trainers: dict[str, TrainerSeries]


class SwarmSnapshot(BaseModel):
    """The whole dashboard: run, map, peers, trainers, history and event log."""

    version: int = Field(description="Grows with every change.")
    updated_at: float | None = Field(description="DHT time of the last poll; null before the first.")
    manifest: ManifestSummary | None
    stages: list[StageView]
    peers: list[PeerView] = Field(description="Peers in the swarm now.")
    gone: list[PeerView] = Field(description="Peers that left recently, most recent first.")
    trainers: list[TrainerView] = Field(description="Latest point of each trainer, most recent first.")
    finished: bool = Field(description="The run applied its last step (the manifest's max_steps).")
    rl: RLSummary | None = Field(
        description="An RL run at a glance; null when the run is no RL run (its manifest names no task; "
        "without a manifest: no rollout peer or RL step is seen)."
    )
    prediction: LayoutPrediction | None = Field(
        description="What the planner's cost model predicts for the live layout; null without a "
        "manifest or while a stage has no serving replica."
    )
    replan: LayoutReplan | None = Field(
        description="The layout the planner would give the serving peers now (in a run with `--replan`, the "
        "lead trainer moves the swarm to one that keeps its gain); null when it would keep theirs, or cannot say."
    )
    series: SeriesView
    events: list[EventView] = Field(description="Event log, newest last.")
