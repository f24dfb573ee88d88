"""The coordinator: a stable bootstrap DHT peer that publishes a run's manifest.

It is not a master. Once peers have joined, training goes on without it; while it runs it
republishes the manifest so the record outlives any single peer, and it announces itself
so `swarmtrain status` can find it. Once an authorized trainer reports the run's last step
committed, it announces the run finished (its record's state), which refuses new trainers.

Any number of coordinators may serve one run. Given peers of an existing swarm
(`node.initial_peers`: another coordinator, a stage peer, a plain hivemind DHT node), a
coordinator looks the run up first:
- the swarm has no manifest of the run: it starts the run there, as its owner;
- it has one this coordinator signed (its identity's key file, after a restart): it serves
  that manifest as it is, signing it anew, whatever the flags that shape a run say;
- it has the manifest of another owner: it serves that one, storing the owner's signed copy
  again as stage peers do, and never signs a manifest of its own, which peers would see as a
  second, conflicting owner of the run.
Two live processes cannot share one identity: a coordinator given the key file of a peer
that runs is refused at start (`NodeConfig.refuse_taken_identity`).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from hivemind.utils import get_dht_time

import swarmtrain
from swarmtrain.errors import ConfigError
from swarmtrain.model import build_model
from swarmtrain.model.registry import NO_IMPORTS
from swarmtrain.peers.dashboard.config import DashboardConfig
from swarmtrain.plan import ReplanConfig
from swarmtrain.swarm import NodeConfig, SwarmNode
from swarmtrain.train.archive import RUN_FORMAT, read_meta
from swarmtrain.train.authority import committed_step, read_points
from swarmtrain.train.layout import FirstLayoutConfig, candidates, first_layout, layout_due, pending_note
from swarmtrain.train.run_length import run_is_over
from swarmtrain.wire.keys import MANIFEST_TTL_S
from swarmtrain.wire.records import (
    BatchConfig,
    CompressionConfig,
    OptimizerConfig,
    PeerRecord,
    RunManifest,
    check_loss_name,
    check_run_id,
    even_split,
)
from swarmtrain.wire.rl_config import RLConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """A run to publish and the node to publish it from."""

    node: NodeConfig = field(default_factory=NodeConfig)
    run_id: str = "demo"
    """Run id; peers pass it as --run-id (optional when the swarm has one run)."""
    model: str = "tiny-gpt"
    """Model builder: a registered name, an installed entry point's name, or 'package.module:function'
    (the owner chose it, so this process imports it; each stage peer must allow it, --allow-model)."""
    model_config: dict = field(default_factory=dict)
    """Keyword arguments for the builder."""
    num_stages: int = 3
    """Pipeline stages; the blocks are split evenly between them unless `stage_bounds` is given."""
    stage_bounds: tuple[int, ...] | None = None
    """Explicit, possibly unequal stages: stage k holds blocks [b[k], b[k+1]) (e.g. from the planner)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    seed: int = 0
    """Run seed: model initialisation and the trainer's data order."""
    max_steps: int = 0
    """Steps the run aims for (0: until stopped)."""
    schedule: str = "readiness"
    """How peers order work and route microbatches: 'readiness' or 'static' (the baseline)."""
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    """Codecs of activations, gradients and replica averaging on the wire (default: none)."""
    loss: str | None = None
    """The loss the last stage computes, by registered name (e.g. 'weighted_cross_entropy'); None:
    the model's own, or 'grpo' for an RL run."""
    rl: RLConfig | None = None
    """An RL run's task and sampling (rollout peers make its data; its loss is a GRPO loss);
    None: not an RL run."""
    trainers: tuple[str, ...] = ()
    """Peer ids of the trainers this run authorizes (the manifest lists them; stage peers take
    microbatches and commit phases from no one else)."""
    weight_readers: tuple[str, ...] | None = None
    """Peer ids that may fetch the run's weights by policy version besides its trainers and
    members (the manifest's `weight_readers`); None: anyone who reaches the swarm."""
    checkpoint_every: int = 100
    """Stage replicas checkpoint their stage every this many steps (0: never)."""
    allow_reinit: bool = False
    """A lost stage with no checkpoint anywhere starts again from the seed instead of waiting."""
    restore_lost_stage_only: bool = False
    """A lost stage comes back from its checkpoint alone; the other stages keep their state."""
    init_from: str | None = None
    """A model directory every stage starts from (`swarmtrain export`'s output), instead of the seed."""
    resume: bool = False
    """`init_from` is a run checkpoint: the run starts again from it, its settings, optimizer
    state and step included (the flags that shape the run are ignored)."""
    checkpoint_dir: str | None = None
    """Gather whole-run checkpoints from the stages into this directory and serve them
    (`peers/archivist.py`); None: no archivist."""
    republish_s: float = 10.0
    """Seconds between republications of the manifest."""
    first_layout: FirstLayoutConfig | None = None
    """Plan the stage bounds from the stage peers that come (`--min-peers`, `--plan-wait`;
    `swarmtrain.train.layout`) instead of publishing them before any peer has joined; None:
    `stage_bounds`, or an even split, from the start."""
    dashboard: DashboardConfig | None = None
    """Serve the swarm dashboard from this process; None: no dashboard."""
    replan: ReplanConfig | None = None
    """The run's rule for re-planning its layout while it runs (`--replan`; the manifest carries
    it): every `replan.every_s`, the lead trainer asks the planner for a layout of the serving
    peers at their measured speeds, and moves the swarm to one that beats the live layout by
    more than `replan.min_gain` for `replan.patience` checks in a row, between two steps
    (`peers/trainer_layout.py`). This coordinator signs each such layout into its manifest.
    None: the layout stays."""

    def __post_init__(self):
        check_run_id(self.run_id)
        if self.rl is not None and self.loss is None:
            object.__setattr__(self, "loss", "grpo")
        if self.loss is not None:
            check_loss_name(self.loss)
        if self.republish_s <= 0:
            raise ConfigError(f"republish_s must be > 0, got {self.republish_s}")
        if self.replan is not None and (self.rl is not None or self.checkpoint_dir is not None):
            raise ConfigError(
                "--replan moves blocks between stages, which RL runs' policy versions and the archivist's "
                "checkpoints do not follow yet: leave out --replan, or --task and --checkpoint-dir"
            )
        if self.first_layout is not None and (self.stage_bounds is not None or self.resume):
            raise ConfigError(
                "--min-peers plans the stage bounds from the peers that come: leave out --stage-bounds "
                "(and --resume, whose run keeps its checkpoint's layout)"
            )


def _check_rl(rl: RLConfig, loss: str | None, seq_len: int) -> None:
    """ConfigError unless the task builds (the owner's choice: its import path is allowed), the
    loss is a GRPO loss, and a prompt with its completion fits the model's input."""
    from swarmtrain.rl.grpo import grpo_config
    from swarmtrain.rl.registry import TaskSources, build_task

    task = build_task(rl.task, rl.task_options, TaskSources(allow=(rl.task,) if ":" in rl.task else ()))
    grpo_config(loss or "")
    longest = max(len(task.tokenizer.encode(task.make_prompt(random.Random(i)))) for i in range(64))
    if longest + task.max_new_tokens > seq_len + 1:
        raise ConfigError(
            f"task {rl.task!r}: a prompt of up to {longest} tokens and an answer of {task.max_new_tokens} "
            f"do not fit the model's {seq_len} positions: give the model a longer seq_len"
        )


def make_manifest(config: CoordinatorConfig) -> RunManifest:
    """The run's manifest; builds the model on the meta device to count its blocks and to
    check that the loss is registered and fits the model's output (ConfigError otherwise)."""
    if config.init_from is not None:
        return _manifest_from(config)
    own_model = NO_IMPORTS.allowing(config.model)  # the owner's choice: no other import path
    model = build_model(config.model, config.model_config, device="meta", sources=own_model)
    model.loss_input_specs(config.loss)
    if config.rl is not None:
        _check_rl(config.rl, config.loss, model.input_shape[0])
    elif (config.loss or "").startswith("grpo"):
        raise ConfigError(
            f"loss {config.loss!r} trains on rollout peers' completions: name the run's task too (--task add)"
        )
    return RunManifest(
        run_id=config.run_id,
        model=config.model,
        model_config=dict(config.model_config),
        num_blocks=model.num_blocks,
        stage_bounds=config.stage_bounds or even_split(model.num_blocks, config.num_stages),
        optimizer=config.optimizer,
        batch=config.batch,
        seed=config.seed,
        max_steps=config.max_steps,
        schedule=config.schedule,
        compression=config.compression,
        loss=config.loss,
        rl=config.rl,
        trainers=tuple(config.trainers),
        weight_readers=config.weight_readers,
        checkpoint_every=config.checkpoint_every,
        instance=secrets.token_hex(6),
        allow_reinit=config.allow_reinit,
        restore_lost_stage_only=config.restore_lost_stage_only,
        replan=config.replan,
        **(
            {"layout_version": 0, "layout_note": pending_note(config.first_layout)}
            if config.first_layout is not None
            else {}
        ),
    )


def _manifest_from(config: CoordinatorConfig) -> RunManifest:
    """The manifest of a run that starts from a model directory (--init-from) or resumes from a
    run checkpoint (--resume); ConfigError when the directory does not fit."""
    where = str(Path(config.init_from).resolve())
    meta = read_meta(where)
    if config.resume:
        if meta["format"] != RUN_FORMAT:
            raise ConfigError(
                f"{where} is an exported model, not a run checkpoint: start a run from it with --init-from, "
                "or write a resumable one with `swarmtrain export --resumable`"
            )
        manifest = RunManifest.from_dict(
            meta["manifest"] | {"trainers": list(config.trainers), "weight_readers": config.weight_readers}
        )
        # a new timeline: checkpoints the stopped run wrote after this one are not its own
        return dataclasses.replace(
            manifest, init_from=where, resume=True, instance=secrets.token_hex(6), replan=config.replan
        )
    model, options = meta["model"], meta["model_config"]
    if (model, options) != (config.model, dict(config.model_config)):
        raise ConfigError(
            f"{where} holds model {model!r} with options {options}: start the run with that --model and "
            f"--model-config (not {config.model!r} with {dict(config.model_config)})"
        )
    manifest = make_manifest(dataclasses.replace(config, init_from=None))
    return dataclasses.replace(manifest, init_from=where)


class Coordinator:
    """Publish (or serve) a run until closed. Starting a new swarm, the manifest is checked
    before any network is touched; joining one, the run is looked up there first."""

    def __init__(self, config: CoordinatorConfig):
        self.config = config
        joining = bool(config.node.initial_peers)
        self.manifest = None if joining else make_manifest(config)
        self.node = SwarmNode(dataclasses.replace(config.node, refuse_taken_identity=joining))
        self.joined_existing = False
        """The run was in the swarm already: this coordinator serves its manifest."""
        if joining:
            try:
                self.manifest = self._existing_manifest() or make_manifest(config)
            except BaseException:
                self.node.shutdown()
                raise
        self.dashboard = None
        if config.dashboard is not None:
            from swarmtrain.peers.dashboard.server import DashboardThread  # needs the [dashboard] extra

            try:
                self.dashboard = DashboardThread(self.node, self.manifest.run_id, config.dashboard)
            except BaseException:
                self.node.shutdown()
                raise
        self.archivist = None
        if config.checkpoint_dir is not None:
            from swarmtrain.peers.archivist import Archivist

            self.archivist = Archivist(self.node, self.manifest, config.checkpoint_dir)
        self._closed = threading.Event()
        self._started = time.monotonic()
        self.progress = 0
        """One past the furthest step an authorized trainer reported committed, as last seen."""
        self.on_layout = lambda message: logger.info("%s", message)
        """Called with a line for people when this coordinator plans its run's first layout, or
        signs a layout its trainers moved the run to."""
        self.finished = False
        """The run's last step was committed (`run_length.run_is_over`); announced in the record."""
        self._publish()
        self._thread = threading.Thread(target=self._republish, name="coordinator-publish", daemon=True)
        self._thread.start()

    @property
    def is_owner(self) -> bool:
        """This coordinator signs the run's manifest (else it serves the owner's signed copy)."""
        return self.node.owner_of(self.manifest.run_id) in (None, self.node.peer_id)

    def _existing_manifest(self) -> RunManifest | None:
        """The manifest of the run in the swarm joined, None if it has none (ConfigError for a
        run that exists when the flags ask to start one from a directory)."""
        run_id = self.config.run_id
        self.node.known_runs()  # also reads the run-list entry a non-owner keeps alive
        manifest = self.node.get_manifest(run_id, prefer_own=True)
        if manifest is None:
            return None
        owner = self.node.owner_of(run_id)
        if self.config.init_from is not None:
            raise ConfigError(
                f"run {run_id!r} already runs in this swarm (owner {owner}): --init-from and --resume start "
                "a run; give another --run-id, or leave them out to serve the running one"
            )
        self.joined_existing = True
        logger.info(
            "run %r is in the swarm already (owner %s): serving its manifest; the flags that shape a run "
            "are not used",
            run_id,
            owner,
        )
        return manifest

    @property
    def addresses(self) -> list[str]:
        return self.node.addresses()

    @property
    def address(self) -> str:
        """The multiaddr to pass other peers as --initial-peers."""
        return self.addresses[0]

    def _publish_every(self) -> float:
        every = self.config.republish_s
        if self.layout_pending:  # look for candidates every second
            return min(1.0, every)
        return every

    @property
    def layout_pending(self) -> bool:
        return self.manifest.layout_version == 0

    def _plan_first_layout(self) -> None:
        """Plan the run's first layout from the candidates there, once it is due (`layout_due`).
        An owner restarted without --min-peers on a run whose layout is still pending plans it
        too, once a peer per stage has come (the --plan-wait default after its start)."""
        m = self.manifest
        config = self.config.first_layout or FirstLayoutConfig(min_peers=m.num_stages)
        records = self.node.peers(m.run_id)
        waiting = candidates(records)
        if not layout_due(config, len(waiting), time.monotonic() - self._started, m.num_stages):
            return
        self.manifest = first_layout(m, records, now=get_dht_time())
        self.on_layout(f"run {m.run_id!r}: layout 1: {self.manifest.layout_note}")

    def _adopt_layout(self) -> None:
        """Sign into the manifest the layout the run's trainers moved it to, where it is newer
        (`wire.layout_record.apply_layout`), so it outlives their layout records."""
        m = self.manifest
        newest = self.node.get_manifest(m.run_id, prefer_own=True)
        if newest is not None and newest.layout_version > m.layout_version:
            self.manifest = newest
            self.on_layout(f"run {m.run_id!r}: layout {newest.layout_version}: {newest.layout_note}")

    def _publish(self) -> None:
        if self.is_owner and self.layout_pending:
            self._plan_first_layout()
        elif self.is_owner and self.manifest.replan is not None:
            self._adopt_layout()
        m = self.manifest
        if self.is_owner:
            self.node.publish_manifest(m, ttl_s=MANIFEST_TTL_S)
        else:  # the owner's signed copy, read again (the owner may have signed a newer one)
            self.manifest = m = self.node.get_manifest(m.run_id) or m
            self.node.store_held_manifest(m.run_id)
        committed = committed_step(read_points(self.node.trainer_points(m.run_id)), m.trainers or None)
        if committed is not None:  # the run's progress outlives its trainers' points (a lost stage
            self.progress = max(self.progress, committed + 1)  # is lost, not new: peers/checkpoints.py)
        if m.max_steps and not self.finished:
            self.finished = run_is_over(m.max_steps, committed, [], None)
            if self.finished:
                logger.info("run %r finished: a trainer committed its last step (%d)", m.run_id, m.max_steps)
        record = PeerRecord(
            peer_id=self.node.peer_id,
            role="coordinator",
            version=swarmtrain.__version__,
            state="finished" if self.finished else "serving",
            step=m.max_steps if self.finished else self.progress,
            checkpoints=self.archivist.held() if self.archivist is not None else (),
        )
        self.node.announce(m.run_id, record, ttl_s=3 * self.config.republish_s)

    def _republish(self) -> None:
        # while the first layout is pending, look for candidates every second
        while not self._closed.wait(self._publish_every()):
            try:
                self._publish()
            except Exception as e:  # a DHT hiccup must not end the coordinator
                logger.warning("republishing the manifest failed: %r", e)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until `close()` is called (or `timeout` passes); True if closed."""
        return self._closed.wait(timeout)

    def close(self) -> None:
        self._closed.set()
        if self.archivist is not None:
            self.archivist.close()
        if self.dashboard is not None:
            self.dashboard.stop()
        self.node.shutdown()

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
