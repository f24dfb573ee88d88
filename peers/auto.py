"""A peer whose role its run's planner picks, and re-picks: `swarmtrain join --role auto`.

In a pre-training run the role is always a stage. In an RL run the peer first measures both
things the planner weighs (`swarmtrain.plan.rl`): its FLOP/s on a block of the run's model
(what a stage replica trains at) and the tokens per second it decodes the run's policy at
(what it would sample at; 0 when two copies of the policy do not fit its memory). It reads
the run's records and takes the role `swarmtrain.rl.roles.choose_role` gives: a stage with no
replica first, else the role that raises the run's samples per second most. It then runs as that peer, announcing
`role_auto` so the planner may move it; when a later check finds that the other role would
raise samples/s by more than 10% at three checks in a row (and it holds no stage's last
replica), it drains, leaves, and comes back in the other role under the same peer id (its
`--identity`, or the default key this process holds).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from swarmtrain.errors import ConfigError
from swarmtrain.model import build_model
from swarmtrain.peers.rollout import RolloutConfig, RolloutPeer
from swarmtrain.peers.self_measure import block_capacity, capacity
from swarmtrain.peers.stage import StageConfig, StagePeer
from swarmtrain.rl.roles import AUTO_KEY, choose_role, probe_prompts
from swarmtrain.swarm import SwarmNode
from swarmtrain.wire.records import RunManifest

logger = logging.getLogger(__name__)


def decode_capacity(manifest: RunManifest, config: RolloutConfig) -> float:
    """Decode tokens/s this machine samples `manifest`'s policy at as a rollout peer with
    `config` would (its quantization, divided by its `slowdown`); 0 if two copies do not fit
    its `max_memory_bytes`."""
    from swarmtrain.rl.generate import measure_decode
    from swarmtrain.rl.grpo import grpo_config
    from swarmtrain.rl.quantize import parameter_bytes, quantize_model
    from swarmtrain.rl.registry import build_task

    model = build_model(manifest.model, manifest.model_config, device=config.device, sources=config.models)
    if config.quantize is not None:
        model = quantize_model(model, config.quantize)
    if config.max_memory_bytes is not None and 2 * parameter_bytes(model) > config.max_memory_bytes:
        return 0.0
    task = build_task(manifest.rl.task, manifest.rl.task_options, config.tasks)
    rate = measure_decode(
        model,
        task,
        samples_per_prompt=manifest.rl.samples_per_prompt,
        prompts=probe_prompts(manifest),
        seconds=config.probe_s,
        temperature=grpo_config(manifest.loss).temperature,
    )
    return rate / config.slowdown


class AutoPeer:
    """Take the planner's role, run as that peer, switch when the planner says so; `run()` blocks.

    `stage` and `rollout` configure the two peers it may run as (the same swarm, run and
    device); `rollout.slowdown` is the sampling slowdown, `stage.slowdown` the training one.
    """

    def __init__(self, stage: StageConfig, rollout: RolloutConfig):
        self.stage_config = stage
        self.rollout_config = rollout
        self.roles: list[str] = []
        """Roles taken so far, in order."""
        self.peer: StagePeer | RolloutPeer | None = None
        """The peer running now."""
        self.on_role: Callable[[str, StagePeer | RolloutPeer], None] = lambda role, peer: None
        """Called with each role and the peer about to run it (set its `on_serving` here)."""
        self._stopped = False

    def choose(self) -> tuple[str, dict]:
        """(role, capacity keys to announce) from the run's manifest and records."""
        node = SwarmNode(self.stage_config.node)
        try:
            manifest = node.require_manifest(self.stage_config.run_id)
            if manifest.rl is None or manifest.layout_version == 0:  # pending: a candidate for a stage
                return "stage", {}
            cfg = self.stage_config
            measured = capacity(
                cfg.device,
                seconds=cfg.probe_s,
                is_spot=cfg.is_spot,
                max_memory_bytes=cfg.max_memory_bytes,
                slowdown=cfg.slowdown,
            )
            measured.update(block_capacity(manifest, cfg.device, slowdown=cfg.slowdown))
            measured["decode_tokens_per_s"] = decode_capacity(manifest, self.rollout_config)
            measured[AUTO_KEY] = True
            records = node.peers(manifest.run_id)
            role = choose_role(
                manifest, records, measured, peer_id=node.peer_id, tasks=self.rollout_config.tasks
            )
            logger.info(
                "run %s: the planner gives this peer the %s role (%.3g FLOP/s, %.3g decode tokens/s)",
                manifest.run_id,
                role,
                measured["flops_per_s"],
                measured["decode_tokens_per_s"],
            )
            return role, measured
        finally:
            node.shutdown()

    def run(self) -> None:
        role, measured = self.choose()
        while role is not None and not self._stopped:
            if role == "trainer":
                raise ConfigError(
                    "this machine fits no stage of the run and cannot hold two copies of its policy: "
                    "drive the run with `swarmtrain train` instead, or give it more --max-memory"
                )
            self.roles.append(role)
            if role == "stage":
                announce = {k: measured[k] for k in ("decode_tokens_per_s", AUTO_KEY) if k in measured}
                self.peer = StagePeer(replace(self.stage_config, auto_role=True, announce=announce))
            else:
                self.peer = RolloutPeer(replace(self.rollout_config, auto_role=True, capacity=measured))
            self.on_role(role, self.peer)
            self.peer.run()
            role = self.peer.switch_role

    def stop(self) -> None:
        self._stopped = True
        if self.peer is not None:
            self.peer.stop()
