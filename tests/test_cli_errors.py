"""Every bad-input case of the command line, each a real `swarmtrain` process: exit code 2,
one line on stderr that says what is wrong and what to do, and no traceback.

A process start costs seconds of imports (torch, hivemind), so the cases run side by side:
the `outcomes` fixture queues them all and runs a few at a time, and each test checks one.
The cases that need a swarm share one coordinator, started while the others run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from swarmtrain.cli.main import app
from tests.conftest import wait_until

SCRIPT = Path(sys.executable).with_name("swarmtrain")
CLI = (str(SCRIPT),) if SCRIPT.exists() else (sys.executable, "-m", "swarmtrain.cli")
"""The installed console script, as users run it."""
PROCESS_TIMEOUT_S = 60.0
"""A case still running after this long has accepted input it should have refused."""
PARALLEL = (os.cpu_count() or 2) + 1
"""Cases run at once: about one per core, plus one for the time they spend waiting on the DHT."""
PEER_ID = "12D3KooWCiAFw8rTr8Bq7H4nhRW8SPpug8M8fpPas952YKMD4frV"
"""A well-formed peer id that no peer has."""
COORDINATOR = (
    "coordinator",
    "--run-id",
    "alpha",
    "--model-config",
    "n_layer=2,d_model=32,n_head=2,seq_len=16",
    "--stages",
    "2",
)


@dataclass(frozen=True)
class Case:
    """A command line and the words its error line must hold. '{address}' (the coordinator's),
    '{busy_port}' and '{nobody}' (a well-formed address no peer answers on) are filled in."""

    args: tuple[str, ...]
    expect: tuple[str, ...]

    @property
    def needs_swarm(self) -> bool:
        return any("{address}" in a for a in self.args)


CASES = {
    # 1. malformed --initial-peers
    "address-bad-port": Case(
        ("join", "--initial-peers", "/ip4/127.0.0.1/tcp/abc"),
        ("--initial-peers '/ip4/127.0.0.1/tcp/abc'", "port 'abc'", "/ip4/HOST/tcp/PORT/p2p/PEER_ID"),
    ),
    "address-garbage-status": Case(
        ("status", "--initial-peers", "/ip4/127.0.0.1/tcp/4001"),
        ("lacks the /p2p/PEER_ID part", "/ip4/HOST/tcp/PORT/p2p/PEER_ID"),
    ),
    "address-garbage": Case(
        ("join", "--initial-peers", "garbage"),
        ("'garbage' is not a peer address", "copy the whole address", "/ip4/HOST/tcp/PORT/p2p/PEER_ID"),
    ),
    # 2. well-formed but nobody answers
    "address-unreachable": Case(
        ("join", "--initial-peers", "{nobody}"),
        ("could not reach", "{nobody}", "check that the coordinator is running"),
    ),
    # 3. wrong run id
    "run-unknown-join": Case(
        ("join", "--initial-peers", "{address}", "--run-id", "beta"),
        ("no run 'beta'", "'alpha'", "--run-id"),
    ),
    "run-unknown-train": Case(
        ("train", "--initial-peers", "{address}", "--run-id", "beta"),
        ("no run 'beta'", "'alpha'", "--run-id"),
    ),
    "run-unknown-status": Case(
        ("status", "--initial-peers", "{address}", "--run-id", "beta"),
        ("no run 'beta'", "'alpha'", "--run-id"),
    ),
    # 4. stage out of range
    "stage-out-of-range": Case(
        ("join", "--initial-peers", "{address}", "--stage", "5"),
        ("stage 5 is out of range", "stages 0..1", "--stage 0..1"),
    ),
    # 5. model builder and its options
    "model-unknown": Case(
        ("coordinator", "--model", "no-such-model"),
        ("unknown model 'no-such-model'", "'tiny-gpt'", "package.module:function"),
    ),
    "model-unimportable": Case(
        ("coordinator", "--model", "nosuchpkg.mod:fn"),
        ("model 'nosuchpkg.mod:fn'", "cannot import module 'nosuchpkg.mod'"),
    ),
    "allow-model-not-a-pattern": Case(
        ("join", "--initial-peers", "{nobody}", "--allow-model", "mylab"),
        ("--allow-model 'mylab' is not a pattern of import paths", "'mylab.models:*'"),
    ),
    "model-bad-option": Case(
        ("coordinator", "--model-config", "foo=1"),
        ("does not take option 'foo'", "n_layer"),
    ),
    "model-config-bad-json": Case(
        ("coordinator", "--model-config", "{bad json"),
        ("--model-config is not valid JSON", "KEY=VALUE"),
    ),
    # 6. port in use
    "port-in-use": Case(
        ("coordinator", "--port", "{busy_port}"),
        ("port {busy_port}", "already in use", "--port"),
    ),
    # 7. bad flags
    "gpu-missing": Case(
        ("join", "--initial-peers", "{nobody}", "--gpu", "cuda:3"),
        ("--gpu cuda:3", "no CUDA device", "--gpu cpu"),
    ),
    "gpu-unknown": Case(
        ("join", "--initial-peers", "{nobody}", "--gpu", "tpu"),
        ("'tpu' is not a device", "auto, cpu, cuda or cuda:N"),
    ),
    "dtype-unknown": Case(
        ("join", "--initial-peers", "{nobody}", "--gpu", "cpu", "--dtype", "half"),
        ("--dtype 'half' is not a compute dtype", "auto, fp32, bf16, fp16"),
    ),
    "quantize-stage": Case(
        ("join", "--initial-peers", "{nobody}", "--quantize", "8bit"),
        ("--quantize is for rollout peers", "--role rollout"),
    ),
    "role-unknown": Case(
        ("join", "--initial-peers", "{nobody}", "--role", "sampler"),
        ("--role must be 'stage', 'rollout' or 'auto', got 'sampler'",),
    ),
    "sample-slowdown-stage": Case(
        ("join", "--initial-peers", "{nobody}", "--sample-slowdown", "4"),
        ("--sample-slowdown is for --role auto", "--slowdown"),
    ),
    "quantize-unknown": Case(
        ("join", "--initial-peers", "{nobody}", "--role", "rollout", "--quantize", "2bit"),
        ("--quantize takes 8bit or 4bit, got '2bit'",),
    ),
    "stages-zero": Case(("coordinator", "--stages", "0"), ("stages must be >= 1, got 0", "--stages 1")),
    "stages-too-many": Case(
        ("coordinator", "--stages", "99"), ("cannot split 4 blocks into 99 stages", "--stages 4")
    ),
    "min-peers-negative": Case(
        ("coordinator", "--min-peers", "-1"),
        ("Invalid value for '--min-peers'", "greater than or equal to 0"),
    ),
    "min-peers-with-bounds": Case(
        ("coordinator", "--min-peers", "2", "--stage-bounds", "0,1,4"),
        ("--min-peers plans the stage bounds from the peers that come: leave out --stage-bounds",),
    ),
    "plan-wait-negative": Case(
        ("coordinator", "--min-peers", "2", "--plan-wait", "-1"), ("Invalid value for '--plan-wait'",)
    ),
    "run-id-invalid": Case(
        ("coordinator", "--run-id", "bad id!"), ("invalid run id 'bad id!'", "letters, digits")
    ),
    "lr-negative": Case(("coordinator", "--lr", "-1"), ("learning rate must be > 0, got -1.0", "--lr")),
    "warmup-negative": Case(
        ("coordinator", "--warmup-steps", "-1"),
        ("warmup_steps must be an integer >= 0, got -1", "--warmup-steps 0 or more"),
    ),
    "warmup-too-long": Case(
        ("coordinator", "--warmup-steps", "10", "--steps", "10"),
        ("warmup_steps 10 would last the whole run of 10 steps", "--warmup-steps below --steps"),
    ),
    "lr-schedule-unknown": Case(
        ("coordinator", "--lr-schedule", "linear"),
        ("unknown learning-rate schedule 'linear'", "'constant' or 'cosine'", "--lr-schedule"),
    ),
    "cosine-without-steps": Case(
        ("coordinator", "--lr-schedule", "cosine"),
        ("the cosine schedule decays over the run's steps", "--steps N", "--lr-schedule constant"),
    ),
    "min-lr-above-lr": Case(
        ("coordinator", "--lr-schedule", "cosine", "--steps", "100", "--min-lr", "0.1"),
        ("min_lr 0.1 is above the learning rate 0.003", "--min-lr of at most --lr"),
    ),
    "min-lr-without-cosine": Case(
        ("coordinator", "--min-lr", "0.0001"),
        ("min_lr 0.0001 ends a cosine schedule", "--lr-schedule cosine"),
    ),
    "max-grad-norm-negative": Case(
        ("coordinator", "--max-grad-norm", "-1"),
        ("max_grad_norm must be a number >= 0, got -1.0", "--max-grad-norm 0 or more"),
    ),
    "microbatch-zero": Case(
        ("coordinator", "--microbatch-size", "0"),
        ("microbatch_size must be a positive integer, got 0", "--microbatch-size 1"),
    ),
    "compress-unknown": Case(
        ("coordinator", "--compress-gradients", "zstd"),
        (
            "unknown codec 'zstd' for gradients",
            "none, fp16, bf16, int8, nf4, uint4, int8-s16, nf4-s16, uint4-s16, auto",
            "--compress-gradients",
        ),
    ),
    "compress-per-boundary-count": Case(
        ("coordinator", "--stages", "2", "--compress-activations", "int8,nf4"),
        (
            "--compress-activations names 2 codecs ('int8,nf4'), but the run has 1 boundary between its 2 stages",
            "give one codec",
        ),
    ),
    "verify-fraction-above-one": Case(
        ("coordinator", "--task", "add", "--verify-fraction", "1.5"),
        ("verify_fraction must be a number in [0, 1]", "got 1.5", "--verify-fraction"),
    ),
    "loss-unknown": Case(
        ("coordinator", "--loss", "focal"),
        ("unknown loss 'focal'", "'cross_entropy', 'weighted_cross_entropy'", "--loss"),
    ),
    "loss-invalid": Case(("coordinator", "--loss", "bad name"), ("invalid loss name 'bad name'", "--loss")),
    "demo-compress-unknown": Case(
        ("demo", "--compress", "zstd"), ("unknown codec 'zstd' for --compress: choose one of none, fp16",)
    ),
    "demo-compress-list": Case(
        ("demo", "--compress", "int8,none"),
        ("--compress takes one codec, got 'int8,none'", "swarmtrain coordinator --compress-activations"),
    ),
    "ready-file-folder-missing": Case(
        ("join", "--initial-peers", "{nobody}", "--ready-file", "/nonexistent-folder/ready"),
        ("--ready-file", "/nonexistent-folder does not exist"),
    ),
    "shard-out-of-range": Case(
        ("train", "--initial-peers", "{nobody}", "--shard", "2/2"), ("--shard 2/2: I must be in 0..1",)
    ),
    # typer's own usage errors, one line like the rest
    "threads-zero": Case(
        ("train", "--initial-peers", "{nobody}", "--threads", "0"),
        ("'--threads'", "greater than or equal to 1"),
    ),
    "option-missing": Case(("join",), ("Missing option '--initial-peers'", "`swarmtrain join --help`")),
    "option-not-an-integer": Case(
        ("coordinator", "--stages", "abc"), ("'--stages'", "integer", "`swarmtrain coordinator --help`")
    ),
    "option-unknown": Case(("coordinator", "--stagez", "3"), ("--stagez", "--stages")),
}


@dataclass(frozen=True)
class Outcome:
    args: tuple[str, ...]
    returncode: int | None
    """None: killed after PROCESS_TIMEOUT_S."""
    stdout: str
    stderr: str
    seconds: float


class Processes:
    """Starts CLI processes, each the leader of its own process group so that ending the group
    also ends its DHT child and p2p daemon. `kill_all()` ends every group started and refuses
    to start more, so that queued cases do not outlive a failure."""

    def __init__(self, cwd: Path):
        self.cwd = cwd
        self.env = {k: v for k, v in os.environ.items() if k != "HIVEMIND_LOGLEVEL"}  # the CLI's own default
        self.env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU-only machine, whatever this one has
        self._started: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._closed = False

    def start(
        self, args: tuple[str, ...], *, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) -> subprocess.Popen:
        with self._lock:
            if self._closed:
                raise RuntimeError("processes are being killed: not starting another")
            proc = subprocess.Popen(
                [*CLI, *args],
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                text=True,
                start_new_session=True,
            )
            self._started.append(proc)
        return proc

    def run(self, args: tuple[str, ...]) -> Outcome:
        started = time.monotonic()
        proc = self.start(args)
        try:
            stdout, stderr = proc.communicate(timeout=PROCESS_TIMEOUT_S)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            self._signal_group(proc, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            returncode = None
        return Outcome(args, returncode, stdout, stderr, time.monotonic() - started)

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # the whole group has exited already
            os.killpg(proc.pid, sig)

    def kill_all(self) -> None:
        """SIGTERM each running group (the coordinator closes cleanly on it), then SIGKILL whatever
        of any group is left, e.g. a daemon whose leader has exited."""
        with self._lock:
            self._closed = True
        running = [p for p in self._started if p.poll() is None]
        for proc in running:
            self._signal_group(proc, signal.SIGTERM)
        for proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for proc in self._started:
            self._signal_group(proc, signal.SIGKILL)
            proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def procs(tmp_path_factory) -> Iterator[Processes]:
    procs = Processes(tmp_path_factory.mktemp("cli"))
    try:
        yield procs
    finally:
        procs.kill_all()


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    """A port on 127.0.0.1 that a listening socket holds for the whole module."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


class CoordinatorProcess:
    """A coordinator of run 'alpha' (2 stages) on 127.0.0.1, started but not yet waited for.
    Its output goes to files: nobody reads its pipes while the cases run."""

    def __init__(self, procs: Processes, folder: Path):
        self.address_file = folder / "address"
        self.log = folder / "coordinator.log"
        with self.log.open("w") as log:
            self.proc = procs.start(
                (*COORDINATOR, "--address-file", str(self.address_file)), stdout=log, stderr=subprocess.STDOUT
            )

    def address(self) -> str:
        """Its peer address, once it has written it; fails the test if it exits first."""
        wait_until(
            lambda: self.address_file.exists() or self.proc.poll() is not None,
            timeout_s=PROCESS_TIMEOUT_S,
            what="the coordinator's address file",
        )
        if not self.address_file.exists():
            pytest.fail(f"the coordinator exited with {self.proc.returncode}: {self.log.read_text()}")
        return self.address_file.read_text().strip()


@pytest.fixture(scope="module")
def coordinator(procs, tmp_path_factory) -> CoordinatorProcess:
    """Killed with every other process by `procs`, also when a test fails."""
    return CoordinatorProcess(procs, tmp_path_factory.mktemp("coordinator"))


@pytest.fixture(scope="module")
def values(busy_port) -> dict[str, str]:
    return {"busy_port": str(busy_port), "nobody": f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{PEER_ID}"}


def fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace("{" + key + "}", value)
    return text


def selected_cases(request) -> list[str]:
    """The cases this session runs: all of them, unless -k or a node id picked fewer."""
    names = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is sys.modules[__name__] and callspec and "name" in callspec.params:
            names.append(callspec.params["name"])
    return names


@pytest.fixture(scope="module")
def outcomes(request, procs, values) -> dict[str, Outcome]:
    """The selected cases' outcomes. The cases without a swarm are queued first; the coordinator
    (if a case needs it) boots meanwhile, and the swarm cases queue behind them once its address
    is known."""
    names = selected_cases(request)
    with ThreadPoolExecutor(PARALLEL) as pool:
        try:
            futures = {
                name: pool.submit(procs.run, tuple(fill(a, values) for a in CASES[name].args))
                for name in names
                if not CASES[name].needs_swarm
            }
            swarm_cases = [name for name in names if CASES[name].needs_swarm]
            if swarm_cases:
                with_address = values | {"address": request.getfixturevalue("coordinator").address()}
                for name in swarm_cases:
                    futures[name] = pool.submit(
                        procs.run, tuple(fill(a, with_address) for a in CASES[name].args)
                    )
            return {name: future.result() for name, future in futures.items()}
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            procs.kill_all()  # so that the running cases end at once
            raise


@pytest.mark.swarm
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_clear_line(name, outcomes, values):
    outcome, case = outcomes[name], CASES[name]
    report = (
        f"swarmtrain {' '.join(outcome.args)} ({outcome.seconds:.1f} s)\n"
        f"--- stderr:\n{outcome.stderr}--- stdout:\n{outcome.stdout}"
    )
    assert outcome.returncode is not None, f"still running after {PROCESS_TIMEOUT_S:.0f} s: {report}"
    assert "Traceback" not in outcome.stderr, report
    lines = [line for line in outcome.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr: {report}"
    assert lines[0].startswith("error: "), report
    for words in case.expect:
        assert fill(words, values) in lines[0], f"{fill(words, values)!r} missing: {report}"
    assert outcome.returncode == 2, report


def test_every_option_documents_its_default():
    """What `--help` shows a newcomer: each option has a help text and either is required or
    shows a default (a flag's is 'off')."""
    import typer.main

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        for param in command.params:
            if param.name == "help":
                continue
            where = f"swarmtrain {name} {param.opts[0]}"
            assert param.help, f"{where} has no help text"
            shows_default = param.show_default not in (None, False) and (
                isinstance(param.show_default, str) or param.default not in (None, "")
            )
            assert param.required or getattr(param, "is_flag", False) or shows_default, (
                f"{where} shows no default"
            )
