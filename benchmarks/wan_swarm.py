"""Real swarmtrain peers over an emulated WAN (`benchmarks/wan.py --peers swarm`).

For each link rate and codec, a fresh WanNet (benchmarks/netns.py) holds: namespace 0 a
`swarmtrain coordinator` (the codec on activations, gradients and averaging) and later the
`swarmtrain train` process and a `swarmtrain status --json` reader; namespaces 1..S one
`swarmtrain join --stage k` each. The trainer's JSONL gives tokens/s per step (median after
`WARMUP_STEPS`); the stage peers' DHT records give bytes on the wire (bytes_sent) and before
compression (raw_bytes_sent). Every process and namespace is removed after each run.

Bottleneck (`bottleneck()`): a stage peer's uplink carries what it sends, so the link allows
at most rate / (the busiest peer's bytes_sent per token) tokens/s; the stages' compute shares
the host's cores, so their busy time summed per host CPU near 1 means the cores are saturated.
Both figures are reported with the verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.netns import WanConfig, WanNet

REPO = Path(__file__).resolve().parent.parent
COORDINATOR_PORT = 31337
RUN_ID = "wan"
WARMUP_STEPS = 2
START_TIMEOUT_S = 180.0
HEARTBEAT_WAIT_S = 5.0
SAMPLE_S = 0.25
"""Seconds between samples of the links' byte counters (`LinkSampler`)."""
"""After training, wait this long so every stage peer has announced its final counters
(stage peers announce every 2 s)."""
CPU_SATURATED = 0.8
"""Stages' busy time per host CPU at or above which the CPU is called the bottleneck."""
LINK_BOUND_FRACTION = 0.5
"""Fraction of the link bound at or above which an unsaturated run is called link-bound. A
step drains the pipeline and each hop stores and forwards whole frames, so a run whose CPUs
idle reaches only ~0.55-0.6 of the bound (measured at 10 Mbit/s with 4-8% busy stages)."""
MODEL_CONFIG = "n_layer=3,d_model=256,n_head=4,seq_len=128"
SEQ_LEN = 128


@dataclass(frozen=True, kw_only=True)
class SwarmRun:
    """What one real-swarm run trains: the model, the batch, and how long."""

    stages: int = 3
    model_config: str = MODEL_CONFIG
    seq_len: int = SEQ_LEN
    microbatch_size: int = 8
    microbatches_per_step: int = 8
    max_in_flight: int = 8
    steps: int = 8
    queue_ms: float = 400.0

    @property
    def tokens_per_step(self) -> int:
        return self.microbatch_size * self.seq_len * self.microbatches_per_step


class RunFailed(RuntimeError):
    """A swarm process exited or stalled; the message carries the tail of its log."""


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarmtrain.cli", *args]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def _spawn_logged(net: WanNet, k: int, argv: list[str], log: Path) -> subprocess.Popen:
    """Start `argv` in namespace k with stdout and stderr to `log`."""
    with open(log, "wb") as out:
        return net.spawn(k, argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=_env())


def _wait_file(proc: subprocess.Popen, path: Path, log: Path, what: str) -> str:
    """The stripped text of `path` once it is non-empty; RunFailed if `proc` exits first or
    START_TIMEOUT_S passes."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size:
            return path.read_text().strip()
        if proc.poll() is not None:
            raise RunFailed(f"{what} exited with code {proc.returncode}:\n{_tail(log)}")
        time.sleep(0.1)
    raise RunFailed(f"{what} did not start within {START_TIMEOUT_S:.0f} s:\n{_tail(log)}")


STREAMS = ("per-frame", "reuse", "paced")
"""The peers' transports a run can compare: a stream per call (the transport before), idle
streams reused, and reused streams with frames paced to the link (`--uplink-mbit`)."""


def _stream_flags(streams: str, rate_mbit: float) -> list[str]:
    if streams == "paced":
        return ["--streams", "reuse", "--uplink-mbit", f"{rate_mbit:g}"]
    return ["--streams", streams]


def start_swarm(net: WanNet, run: SwarmRun, codec: str, tmp: Path, streams: str = "reuse") -> str:
    """Start the coordinator in namespace 0 and one stage peer per stage in namespaces
    1..stages; return the coordinator's address once every stage peer serves."""
    address_file, log = tmp / "coordinator.address", tmp / "coordinator.log"
    coordinator = _spawn_logged(net, 0, _cli(
        "coordinator", "--run-id", RUN_ID, "--model", "tiny-gpt", "--model-config", run.model_config,
        "--stages", str(run.stages), "--microbatch-size", str(run.microbatch_size),
        "--microbatches-per-step", str(run.microbatches_per_step), "--max-in-flight", str(run.max_in_flight),
        "--compress-activations", codec, "--compress-gradients", codec, "--compress-averaging", codec,
        "--host", net.address(0), "--port", str(COORDINATOR_PORT), "--address-file", str(address_file),
    ), log)  # fmt: skip
    address = _wait_file(coordinator, address_file, log, "coordinator")
    joins = []
    for stage in range(run.stages):
        k = stage + 1
        ready, log = tmp / f"stage{stage}.ready", tmp / f"stage{stage}.log"
        proc = _spawn_logged(net, k, _cli(
            "join", "--initial-peers", address, "--run-id", RUN_ID, "--stage", str(stage), "--gpu", "cpu",
            "--host", net.address(k), "--threads", "1", "--rebalance-every", "0", "--ready-file", str(ready),
            *_stream_flags(streams, net.config.rate_mbit),
        ), log)  # fmt: skip
        joins.append((proc, ready, log, f"stage {stage} peer"))
    for proc, ready, log, what in joins:
        _wait_file(proc, ready, log, what)
    return address


def train(net: WanNet, run: SwarmRun, address: str, tmp: Path, streams: str = "reuse") -> list[dict]:
    """Run `swarmtrain train --jsonl` in namespace 0 to the end; its per-step records."""
    log = tmp / "train.log"
    argv = _cli("train", "--initial-peers", address, "--run-id", RUN_ID, "--steps", str(run.steps),
                "--threads", "1", "--jsonl", *_stream_flags(streams, net.config.rate_mbit))  # fmt: skip
    with open(log, "wb") as err:
        proc = net.spawn(0, argv, stdout=subprocess.PIPE, stderr=err, cwd=REPO, env=_env(), text=True)
        try:
            out, _ = proc.communicate(timeout=START_TIMEOUT_S + 60 * run.steps)
        except subprocess.TimeoutExpired:
            raise RunFailed(f"train did not finish {run.steps} steps in time:\n{_tail(log)}") from None
    steps = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(steps) < run.steps:
        raise RunFailed(f"train exited with code {proc.returncode} after {len(steps)} steps:\n{_tail(log)}")
    return steps


def stage_records(net: WanNet, address: str) -> list[dict]:
    """The stage peers' records from `swarmtrain status --json`, run in namespace 0."""
    argv = net.command(0, _cli("status", "--json", "--initial-peers", address, "--run-id", RUN_ID))
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=120)
    if proc.returncode != 0:
        raise RunFailed(f"status exited with code {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return [p for p in json.loads(proc.stdout)["peers"] if p.get("role") == "stage"]


def measure(run: SwarmRun, rate_mbit: float, codec: str, streams: str = "reuse") -> dict:
    """One fresh swarm at `rate_mbit` with `codec`, its peers' calls on `streams` ('reuse' or
    'per-frame'): its step records and stage peer records."""
    config = WanConfig(num_peers=run.stages + 1, rate_mbit=rate_mbit, queue_ms=run.queue_ms)
    with tempfile.TemporaryDirectory(prefix="wan-swarm-") as tmp, WanNet(config) as net:
        address = start_swarm(net, run, codec, Path(tmp), streams)
        sampler = LinkSampler(net)
        sampler.start()
        try:
            steps = train(net, run, address, Path(tmp), streams)
        except RunFailed as e:  # what the stage peers said of each other's frames, if anything
            raise RunFailed(f"{e}\nstage peers' bad frames: {_bad_frames(Path(tmp))}") from None
        finally:
            sampler.stop()
        time.sleep(HEARTBEAT_WAIT_S)
        return {"steps": steps, "peers": stage_records(net, address), "qdisc": net.qdiscs()[1],
                "bad_frames": _bad_frames(Path(tmp)), "uplink_full": sampler.full_fractions(rate_mbit)}  # fmt: skip


class LinkSampler(threading.Thread):
    """Samples every peer's uplink byte counter every SAMPLE_S while a run trains, to tell a
    link that is the bottleneck (full whenever it is in use) from one that waits in between."""

    def __init__(self, net: WanNet):
        super().__init__(daemon=True)
        self.net = net
        self.samples: list[tuple[float, list[int]]] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(SAMPLE_S):
            try:
                self.samples.append((time.monotonic(), self.net.uplink_bytes()))
            except Exception:  # the namespaces went away at the end of the run
                return

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=10)

    def full_fractions(self, rate_mbit: float) -> dict[int, float]:
        """Per namespace (0: trainer and coordinator, k + 1: stage k): the share of the sampled
        intervals in which its uplink carried anything (over 5% of the rate) where it ran at 90%
        of the rate or more."""
        rate = rate_mbit * 1e6 / 8
        out = {}
        for k in range(len(self.samples[0][1]) if self.samples else 0):
            active = full = 0
            for (t0, a), (t1, b) in zip(self.samples, self.samples[1:]):
                used = (b[k] - a[k]) / (t1 - t0) / rate
                if used > 0.05:
                    active += 1
                    full += used >= 0.9
            out[k] = round(full / active, 2) if active else 0.0
        return out


def _bad_frames(tmp: Path) -> list[str]:
    """The stage peers' log lines about bad frames and bans (a frame that stalled on the link
    reads as one)."""
    lines = []
    for log in sorted(tmp.glob("stage*.log")):
        lines += [f"{log.stem}: {line.strip()}" for line in log.read_text(errors="replace").splitlines()
                  if "bad frame from" in line or "banned peer" in line]  # fmt: skip
    return lines[:20]


def summarize(run: SwarmRun, rate_mbit: float, codec: str, measured: dict, streams: str = "reuse") -> dict:
    """Tokens/s (median after warm-up), wire bytes per token, compression, and the bottleneck."""
    steps, peers = measured["steps"], measured["peers"]
    per_step = [s["tokens_per_s"] for s in steps[WARMUP_STEPS:]] or [s["tokens_per_s"] for s in steps]
    tokens_per_s = statistics.median(per_step)
    tokens = sum(s["tokens"] for s in steps)
    train_s = sum(s["seconds"] for s in steps)
    sent = sum(p["bytes_sent"] for p in peers)
    raw = sum(p["raw_bytes_sent"] for p in peers)
    busiest = max((p["bytes_sent"] for p in peers), default=0)
    link_bound = rate_mbit * 1e6 / 8 / (busiest / tokens) if busiest else float("inf")
    of_link = tokens_per_s / link_bound
    busy = {p["stage"]: round(p["busy_s"] / train_s, 2) for p in peers}
    busy_per_cpu = sum(p["busy_s"] for p in peers) / train_s / (os.cpu_count() or 1)
    return {
        "codec": codec,
        "streams": streams,
        "tokens_per_s": round(tokens_per_s),
        "tokens_per_s_per_step": [round(t) for t in per_step],
        "steps": len(steps),
        "replays": sum(s["replays"] for s in steps),
        "wire_bytes_per_token": round(sent / tokens, 1),
        "raw_bytes_per_token": round(raw / tokens, 1),
        "compression_ratio": round(raw / sent, 2) if sent else None,
        "busiest_uplink_bytes_per_token": round(busiest / tokens, 1),
        "link_bound_tokens_per_s": round(link_bound),
        "of_link_bound": round(of_link, 2),
        "stage_busy_fraction": busy,
        "stage_busy_per_cpu": round(busy_per_cpu, 2),
        "bottleneck": bottleneck(of_link, busy_per_cpu),
        "bad_frames": measured.get("bad_frames", []),
        "uplink_full_when_used": measured.get("uplink_full", {}),
    }


def bottleneck(of_link_bound: float, busy_per_cpu: float) -> str:
    """'cpu' if the stages keep the host's cores busy (CPU_SATURATED), else 'link' if the run
    reaches LINK_BOUND_FRACTION of the link bound, else 'unclear'."""
    if busy_per_cpu >= CPU_SATURATED:
        return "cpu"
    return "link" if of_link_bound >= LINK_BOUND_FRACTION else "unclear"


def add_speedups(rows: list[dict]) -> None:
    """Set each row's speedup_vs_none against the 'none' row of the same rate and streams, and
    each 'reuse' or 'paced' row's reuse_vs_per_frame against the 'per-frame' row of its codec (None without one)."""
    for r in rows:
        streams = r.get("streams", "reuse")
        base = next(
            (
                b["tokens_per_s"]
                for b in rows
                if b["codec"] == "none" and b.get("streams", "reuse") == streams
            ),
            None,
        )
        r["speedup_vs_none"] = round(r["tokens_per_s"] / base, 2) if base else None
        if streams != "per-frame":
            old = next(
                (
                    b["tokens_per_s"]
                    for b in rows
                    if b["codec"] == r["codec"] and b.get("streams") == "per-frame"
                ),
                None,
            )
            r["reuse_vs_per_frame"] = round(r["tokens_per_s"] / old, 2) if old else None


def run_all(args: argparse.Namespace, rates: list[float]) -> dict:
    """Every rate x codec run; the JSON document `wan.py --peers swarm` prints."""
    m = args.microbatches_per_step
    run = SwarmRun(steps=args.steps, queue_ms=args.queue_ms, microbatches_per_step=m, max_in_flight=m)
    measured = []
    for rate in rates:
        rows = []
        for codec in args.codecs:
            for streams in args.streams:  # side by side: each codec on each transport in turn
                print(f"swarm: {rate:g} Mbit/s, {codec}, streams {streams} ...", file=sys.stderr, flush=True)
                started = time.monotonic()
                try:
                    result = measure(run, rate, codec, streams)
                except RunFailed as e:
                    rows.append({"codec": codec, "streams": streams, "error": str(e)})
                    continue
                row = summarize(run, rate, codec, result, streams)
                row["wall_s"] = round(time.monotonic() - started, 1)
                rows.append(row)
        add_speedups([r for r in rows if "error" not in r])
        measured.append({"rate_mbit": rate, "results": rows})
    return {
        "benchmark": "wan-swarm",
        "topology": f"{run.stages + 1} namespaces on a bridge (coordinator + trainer in 0, stage k in k+1), "
        "tbf on each peer's uplink and downlink",
        "model": f"tiny-gpt {run.model_config}, {run.stages} stages",
        "batch": {
            "microbatch_size": run.microbatch_size,
            "microbatches_per_step": run.microbatches_per_step,
            "max_in_flight": run.max_in_flight,
            "tokens_per_step": run.tokens_per_step,
        },
        "steps": run.steps,
        "warmup_steps": WARMUP_STEPS,
        "queue_ms": run.queue_ms,
        "bottleneck_rule": f"cpu if stage_busy_per_cpu >= {CPU_SATURATED}, else link if of_link_bound >= "
        f"{LINK_BOUND_FRACTION} (link bound: rate / busiest uplink bytes per token), else unclear",
        "rates": measured,
        "host_cpus": os.cpu_count(),
    }
