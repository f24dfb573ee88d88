import os

os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")
# Before anything imports triton: without a GPU the kernel tests run under Triton's interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

# Keys, pins and default identities go to a scratch data dir, never the user's own.
os.environ["SWARMTRAIN_HOME"] = tempfile.mkdtemp(prefix="swarmtrain-home-")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

TINY_GPT = {"n_layer": 4, "d_model": 32, "n_head": 2, "seq_len": 16, "vocab_size": 256}


@pytest.fixture(autouse=True)
def own_data_dir(tmp_path, monkeypatch):
    """Each test (and every process it starts) gets its own data dir: default identities and
    the owners pinned for run ids do not leak from one test into the next."""
    monkeypatch.setenv("SWARMTRAIN_HOME", str(tmp_path / "swarmtrain-home"))


@pytest.fixture
def local_swarm(tmp_path):
    """Factory for LocalSwarms that are closed (every process reaped) at teardown."""
    from swarmtrain.peers.launcher import LocalSwarm, LocalSwarmConfig

    swarms = []

    def make(**overrides) -> LocalSwarm:
        overrides.setdefault("log_dir", str(tmp_path / f"swarm{len(swarms)}"))
        swarm = LocalSwarm(LocalSwarmConfig(**overrides))
        swarms.append(swarm)
        swarm.start()
        return swarm

    yield make
    for swarm in swarms:
        swarm.close()


POLL_S = 0.1


def wait_until(condition, *, timeout_s: float, what: str) -> None:
    """Poll `condition` until it holds; fail the test after `timeout_s` seconds.

    The one place tests wait on something outside the process (a file, a DHT record): a
    poll with a deadline, never a fixed sleep standing in for synchronization.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)


def holds_for(condition, *, duration_s: float, what: str) -> None:
    """Check `condition` at every poll for `duration_s` seconds (e.g. that nothing flaps)."""
    until = time.monotonic() + duration_s
    while time.monotonic() < until:
        assert condition(), f"{what} stopped holding"
        time.sleep(POLL_S)


def reference_losses(
    *,
    seed: int,
    optimizer,
    batches,
    steps: int,
    microbatches_per_step: int,
    model_config=None,
    max_steps: int = 0,
):
    """Per-step losses (and final state) of single-process training of tiny-gpt on `batches`,
    as steps of a run of `max_steps` (its learning-rate schedule): what a swarm's run must
    match. Returns train_reference's result."""
    from swarmtrain.train.reference import train_reference

    return train_reference(
        model="tiny-gpt",
        model_config=model_config or TINY_GPT,
        seed=seed,
        optimizer=optimizer,
        batches=batches,
        steps=steps,
        microbatches_per_step=microbatches_per_step,
        max_steps=max_steps,
    )


def assert_losses_match_reference(results, reference, *, rtol: float = 1e-4) -> None:
    """A swarm's per-step losses equal single-process training's (`reference_losses`)."""
    import torch

    losses = torch.tensor([r.loss for r in results])
    torch.testing.assert_close(losses, torch.tensor(reference.losses), rtol=rtol, atol=0)


def assert_replicas_verified(results, *, some_compared: bool = True) -> None:
    """Steps trained with verify_replicas: wherever a stage's replicas were compared (two or
    more answered the apply) they hashed equal, and elsewhere the verdict says nothing was
    compared (None, never a vacuous True). With `some_compared`, at least one step compared
    two replicas."""
    compared = [max(r.replicas_compared.values(), default=0) >= 2 for r in results]
    assert [r.replicas_equal for r in results] == [True if c else None for c in compared], [
        (r.step, r.replicas_equal, r.replicas_compared) for r in results
    ]
    if some_compared:
        assert any(compared), [r.replicas_compared for r in results]


@contextlib.asynccontextmanager
async def p2p_pair():
    """(server, client): two hivemind P2P daemons on 127.0.0.1, the client connected to the server."""
    from hivemind.p2p import P2P

    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(initial_peers=await server.get_visible_maddrs())
    try:
        yield server, client
    finally:
        await client.shutdown()
        await server.shutdown()


def assert_trains_like_the_reference(
    swarm, batches, *, steps: int, seed: int, optimizer, microbatches_per_step: int
):
    """Train `steps` steps on `swarm` (its first trainer) from `batches()` and check the losses
    against single-process training on the same data; returns the results."""
    with swarm.trainer() as trainer:
        results = list(trainer.train(batches(), steps=steps))
    reference = reference_losses(
        seed=seed,
        optimizer=optimizer,
        batches=batches(),
        steps=steps,
        microbatches_per_step=microbatches_per_step,
    )
    assert_losses_match_reference(results, reference)
    return results
