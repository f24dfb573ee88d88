"""Spawn a whole swarm on this machine: a coordinator, stage peers and rollout peers as processes.

Each peer is a real `swarmtrain` CLI process in its own process group (its hivemind DHT
process and p2pd daemon included), so `close()` or a kill of one peer takes down exactly
that peer's processes. Used by `swarmtrain demo`, the tests and the examples.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from swarmtrain.errors import ConfigError, SwarmError
from swarmtrain.wire.records import BatchConfig, CompressionConfig, OptimizerConfig
from swarmtrain.wire.rl_config import RLConfig


@dataclass(frozen=True, kw_only=True)
class LocalSwarmConfig:
    """A local swarm: the run it serves and how its processes are started."""

    run_id: str = "demo"
    model: str = "tiny-gpt"
    model_config: dict = field(default_factory=dict)
    num_stages: int = 3
    stage_bounds: tuple[int, ...] | None = None
    """Explicit (unequal) stage boundaries; None splits the blocks evenly into num_stages."""
    stage_args: dict = field(default_factory=dict)
    """Extra `swarmtrain join` flags for the first peer of a stage, e.g. {2: ("--slowdown", "4")};
    with `min_peers`, for the k-th stage peer started."""
    min_peers: int = 0
    """Plan the stage bounds from the stage peers that come (the coordinator's --min-peers): this
    many stage peers start without a stage, and the coordinator sizes the stages to them once
    they have measured themselves. 0: the stages are set from the start, one peer each."""
    plan_wait_s: float = 60.0
    """With `min_peers`: the coordinator's --plan-wait."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    seed: int = 0
    max_steps: int = 0
    """Steps the run lasts (the coordinator's --steps); 0: until stopped."""
    schedule: str = "readiness"
    """'readiness' or 'static' (the run manifest's schedule)."""
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    """Codecs on the wire (the run manifest's compression)."""
    loss: str | None = None
    """The run's loss by registered name (the run manifest's loss); None: the model's own, or
    'grpo' for an RL run."""
    rl: RLConfig | None = None
    """Make it an RL run on this task (the coordinator's --task and its RL flags); None: not one."""
    rollout_peers: int = 0
    """Rollout peers (`join --role rollout`) started with the swarm; only for an RL run."""
    init_from: str | None = None
    """A model directory every stage starts from (`save_model`'s or `swarmtrain export`'s
    output; the coordinator's --init-from), e.g. a warmed-up policy; None: the run seed."""
    host: str = "127.0.0.1"
    """Address every peer listens on."""
    coordinator_port: int = 0
    """Coordinator's TCP port (0: any free port)."""
    dashboard_port: int | None = None
    """Serve the coordinator's dashboard on this port (0: any free port); None: no dashboard."""
    threads_per_peer: int = 1
    """torch threads of each stage peer."""
    log_dir: str | None = None
    """Where each process's output goes; None makes a temporary folder, removed when the swarm
    closes cleanly (kept, and named in the error, when it fails)."""
    keep_logs: bool = False
    """Keep the temporary log folder after a clean close too."""
    startup_timeout_s: float = 120.0
    """How long a peer may take to start before the launch fails."""
    env: dict = field(default_factory=dict)
    """Extra environment for every process."""
    swarm_key: str | None = None
    """A private swarm's key file every process gets (--swarm-key); None: an open swarm."""
    coordinator_args: tuple[str, ...] = ()
    """Extra `swarmtrain coordinator` flags, e.g. ("--checkpoint-every", "2")."""
    initial_peers: tuple[str, ...] = ()
    """Peers of an existing swarm the coordinator joins (--initial-peers); empty: a new swarm."""
    num_trainers: int = 2
    """Trainer identities the run authorizes (`trainer_identity(n)` gives the n-th key file);
    0 authorizes any trainer (benchmarks' baseline for the cost of authorization)."""

    def __post_init__(self):
        if self.rollout_peers < 0:
            raise ConfigError(f"rollout_peers must be >= 0, got {self.rollout_peers}")
        if self.rl is None:
            if self.rollout_peers:
                raise ConfigError(
                    f"{self.rollout_peers} rollout peer(s) but no RL task: rollout peers sample "
                    "completions of an RL run's task, give rl=RLConfig(task=...)"
                )
            return
        self.rl.prompts_per_step(self.batch.microbatch_size * self.batch.microbatches_per_step)


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarmtrain.cli", *args]


def _optional(flag: str, value) -> list[str]:
    return [] if value is None else [flag, str(value)]


def rl_flags(rl: RLConfig | None) -> list[str]:
    """The `swarmtrain coordinator` flags that make its run the RL run `rl` (none for None)."""
    if rl is None:
        return []
    return [
        "--task", rl.task,
        "--task-options", json.dumps(rl.task_options),
        "--samples-per-prompt", str(rl.samples_per_prompt),
        "--max-staleness", str(rl.max_staleness),
        "--weights-codec", rl.weights_codec,
        "--verify-fraction", str(rl.verify_fraction),
        "--logprob-tolerance", str(rl.logprob_tolerance),
    ]  # fmt: skip


class LocalSwarm:
    """`with LocalSwarm(config) as swarm:` a coordinator, one peer per stage and the config's
    rollout peers, up and serving."""

    def __init__(self, config: LocalSwarmConfig | None = None, **overrides):
        self.config = config or LocalSwarmConfig(**overrides)
        self.log_dir = Path(self.config.log_dir or tempfile.mkdtemp(prefix="swarmtrain-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._temporary_logs = self.config.log_dir is None
        # the hand-off files of a swarm that used this folder before: read, they would point
        # this one at processes that are gone (logs and keys stay: a key is a peer's identity)
        for stale in [*self.log_dir.glob("*.address"), *self.log_dir.glob("*.ready")]:
            stale.unlink(missing_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.address = ""
        self.dashboard_url: str | None = None
        self._count = 0

    def __enter__(self) -> LocalSwarm:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(clean=exc_type is None)

    # processes

    def _env(self) -> dict:
        env = dict(os.environ, **{k: str(v) for k, v in self.config.env.items()})
        paths = [os.getcwd(), sys.path[0], env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        """Start `swarmtrain ARGS` as process `name`, output to `log_dir/name.log`."""
        with open(self.log_dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                cli_command(*args),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(),
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _wait_file(self, name: str, path: Path) -> str:
        deadline = time.monotonic() + self.config.startup_timeout_s
        proc = self.procs[name]
        while time.monotonic() < deadline:
            if path.exists() and path.stat().st_size:
                return path.read_text().strip()
            if proc.poll() is not None:
                raise SwarmError(
                    f"{name} exited with code {proc.returncode} while starting (its log: "
                    f"{self.log_dir / name}.log):\n{self.log_tail(name)}"
                )
            time.sleep(0.05)
        raise SwarmError(
            f"{name} did not start within {self.config.startup_timeout_s:.0f} s (its log: "
            f"{self.log_dir / name}.log):\n{self.log_tail(name)}"
        )

    def identity(self, name: str) -> Path:
        """The key file of process `name` (made when first used), in the log folder: a local
        swarm's peers keep their ids out of the user's own data dir."""
        return self.log_dir / f"{name}.key"

    def trainer_identity(self, n: int = 0) -> Path:
        """The key file of the run's `n`-th authorized trainer (0 <= n < num_trainers)."""
        if not 0 <= n < self.config.num_trainers:
            raise SwarmError(f"this swarm authorizes trainers 0..{self.config.num_trainers - 1}, not {n}")
        return self.identity(f"trainer-{n}")

    def trust_args(self, name: str) -> list[str]:
        """`--identity` and `--swarm-key` flags of process `name`."""
        return ["--identity", str(self.identity(name)), *_optional("--swarm-key", self.config.swarm_key)]

    def start(self) -> None:
        from swarmtrain.trust.identity import Identity

        cfg = self.config
        trainers = [Identity.load(self.trainer_identity(n)).peer_id for n in range(cfg.num_trainers)]
        address_file = self.log_dir / "coordinator.address"
        self.spawn(
            "coordinator",
            [
                "coordinator",
                "--run-id", cfg.run_id,
                "--model", cfg.model,
                "--model-config", json.dumps(cfg.model_config),
                "--stages", str(cfg.num_stages),
                *_optional("--stage-bounds", ",".join(map(str, cfg.stage_bounds)) if cfg.stage_bounds else None),
                *(["--min-peers", str(cfg.min_peers), "--plan-wait", str(cfg.plan_wait_s)] if cfg.min_peers else []),
                "--optimizer", cfg.optimizer.name,
                "--lr", str(cfg.optimizer.lr),
                "--weight-decay", str(cfg.optimizer.weight_decay),
                "--warmup-steps", str(cfg.optimizer.warmup_steps),
                "--lr-schedule", cfg.optimizer.schedule,
                "--min-lr", str(cfg.optimizer.min_lr),
                "--max-grad-norm", str(cfg.optimizer.max_grad_norm),
                "--microbatch-size", str(cfg.batch.microbatch_size),
                "--microbatches-per-step", str(cfg.batch.microbatches_per_step),
                "--max-in-flight", str(cfg.batch.max_in_flight),
                "--seed", str(cfg.seed),
                "--steps", str(cfg.max_steps),
                "--schedule", cfg.schedule,
                "--compress-activations", cfg.compression.activations,
                "--compress-gradients", cfg.compression.gradients,
                "--compress-averaging", cfg.compression.averaging,
                "--error-feedback" if cfg.compression.error_feedback else "--no-error-feedback",
                *_optional("--loss", cfg.loss),
                *rl_flags(cfg.rl),
                *_optional("--init-from", cfg.init_from),
                "--host", cfg.host,
                "--port", str(cfg.coordinator_port),
                "--address-file", str(address_file),
                *[arg for peer in cfg.initial_peers for arg in ("--initial-peers", peer)],
                *_optional("--dashboard-port", cfg.dashboard_port),
                *([arg for t in trainers for arg in ("--trainer", t)] or ["--any-trainer"]),
                *self.trust_args("coordinator"),
                *cfg.coordinator_args,
            ],
        )  # fmt: skip
        self.address = self._wait_file("coordinator", address_file)
        self.dashboard_url = next(
            (
                line.split()[-1]
                for line in self.log_tail("coordinator", 20).splitlines()
                if line.startswith("dashboard:")
            ),
            None,
        )
        if cfg.min_peers:  # the coordinator gives each its stage once they have all measured themselves
            names = [
                self.spawn_stage(None, extra_args=tuple(cfg.stage_args.get(k, ())), wait=False)
                for k in range(cfg.min_peers)
            ]
        else:
            names = [
                self.spawn_stage(k, extra_args=tuple(cfg.stage_args.get(k, ())), wait=False)
                for k in range(self.num_stages)
            ]
        names += [self.spawn_rollout(wait=False) for _ in range(cfg.rollout_peers)]
        for name in names:
            self.wait_ready(name)

    @property
    def num_stages(self) -> int:
        bounds = self.config.stage_bounds
        return len(bounds) - 1 if bounds else self.config.num_stages

    def spawn_stage(self, stage: int | None, *, extra_args: tuple[str, ...] = (), wait: bool = True) -> str:
        """Start one more stage peer (of `stage`, or of the stage that needs it); returns its name."""
        self._count += 1
        name = f"stage{'' if stage is None else stage}-{self._count}"
        args = [
            "join",
            "--initial-peers", self.address,
            "--run-id", self.config.run_id,
            "--gpu", "cpu",
            "--threads", str(self.config.threads_per_peer),
            "--host", self.config.host,
            "--ready-file", str(self.log_dir / f"{name}.ready"),
            *_optional("--stage", stage),
            *self.trust_args(name),
            *self._allow_own_model(),
            *extra_args,
        ]  # fmt: skip
        self.spawn(name, args)
        if wait:
            self.wait_ready(name)
        return name

    def spawn_rollout(self, *, extra_args: tuple[str, ...] = (), wait: bool = True) -> str:
        """Start a rollout peer of this (RL) run; returns its name."""
        return self.spawn_role("rollout", extra_args=extra_args, wait=wait)

    def spawn_role(self, role: str, *, extra_args: tuple[str, ...] = (), wait: bool = True) -> str:
        """Start a peer with `join --role ROLE` ('rollout' or 'auto'); returns its name."""
        self._count += 1
        name = f"{role}-{self._count}"
        args = [
            "join", "--role", role,
            "--initial-peers", self.address,
            "--run-id", self.config.run_id,
            "--gpu", "cpu",
            "--threads", str(self.config.threads_per_peer),
            "--host", self.config.host,
            "--ready-file", str(self.log_dir / f"{name}.ready"),
            *self.trust_args(name),
            *self._allow_own_model(),
            *extra_args,
        ]  # fmt: skip
        self.spawn(name, args)
        if wait:
            self.wait_ready(name)
        return name

    def _allow_own_model(self) -> list[str]:
        # Whoever launches this swarm chose its model: its stage peers may import it.
        model = self.config.model
        return ["--allow-model", model] if ":" in model else []

    def wait_ready(self, name: str) -> str:
        """Wait until peer `name` serves; returns its peer id."""
        return self._wait_file(name, self.log_dir / f"{name}.ready")

    def signal(self, name: str, sig: int = signal.SIGTERM) -> None:
        """Send `sig` to peer `name`: SIGKILL goes to its whole process group (its DHT process
        and daemon die with it, as on a lost machine), other signals to the peer process alone."""
        proc = self.procs[name]
        try:
            if sig == signal.SIGKILL:
                os.killpg(proc.pid, sig)
            elif proc.poll() is None:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def close(self, timeout_s: float = 10.0, *, clean: bool = False) -> None:
        """SIGTERM every peer, wait up to `timeout_s`, then SIGKILL what is left of its group.
        `clean` (the swarm did its job): remove a temporary log folder unless `keep_logs`."""
        try:
            self._stop(timeout_s)
        finally:
            if clean and self._temporary_logs and not self.config.keep_logs:
                shutil.rmtree(self.log_dir, ignore_errors=True)

    def _stop(self, timeout_s: float) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()  # the leader alone: it shuts its DHT process and daemon down itself
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the group may outlive its leader
            proc.wait()

    def node_config(self, *, identity: Path | None = None, **overrides):
        """A NodeConfig that joins this swarm (its key, if private), as `identity` (None: a fresh one)."""
        from swarmtrain.swarm import NodeConfig

        settings = dict(
            initial_peers=(self.address,),
            host=self.config.host,
            identity_path=None if identity is None else str(identity),
            swarm_key_path=self.config.swarm_key,
        )
        return NodeConfig(**(settings | overrides))

    def trainer(self, n: int = 0, **overrides):
        """A Trainer connected to this swarm as its `n`-th authorized trainer (the caller closes it)."""
        from swarmtrain.peers.trainer import Trainer, TrainerConfig

        node = self.node_config(identity=self.trainer_identity(n) if self.config.num_trainers else None)
        return Trainer(TrainerConfig(node=node, run_id=self.config.run_id, **overrides))
