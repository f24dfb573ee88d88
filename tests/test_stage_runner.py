"""StageRunner without networking: stages chained by hand train exactly like one model, a
replayed microbatch adds its gradient once, and a step goes through only on complete gradients."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.errors import BadFrameError, RemoteError
from swarmtrain.model import build_model, build_stage
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.train.reference import stage_state_dict, train_reference
from swarmtrain.train.stage_runner import StageRunner
from swarmtrain.wire.records import OptimizerConfig

GPT = "tiny-gpt"
CFG = {"n_layer": 4, "d_model": 32, "n_head": 2, "seq_len": 16}
B, T, C = 2, 16, 32  # microbatch size, seq_len, d_model
SEED = 5
SGD = OptimizerConfig(name="sgd", lr=0.5, momentum=0.9)
ADAMW = OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1)


@pytest.fixture(scope="module")
def text() -> bytes:
    return stdlib_text(max_bytes=2**20)


def batches(text: bytes, seed: int = 11) -> TokenBatches:
    return TokenBatches(text, seq_len=T, microbatch_size=B, seed=seed)


def make_runners(bounds: tuple[int, ...], optimizer: OptimizerConfig = SGD) -> list[StageRunner]:
    return [
        StageRunner(build_stage(GPT, CFG, a, b, num_blocks=4, seed=SEED), optimizer, microbatch_size=B)
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]


def run_microbatch(
    runners: list[StageRunner], mb_id: str, x, y, loss_scale: float, *, replay: bool = False
) -> float:
    """Forward through every stage, loss and backward on the last, backward back to the first."""
    h = x
    for runner in runners[:-1]:
        runner.check_inputs(h, y)
        h = runner.forward(mb_id, h)
    runners[-1].check_inputs(h, y)
    loss, grad = runners[-1].forward_loss_backward(mb_id, h, y, loss_scale, replay=replay)
    for runner in reversed(runners[:-1]):
        grad = runner.backward(mb_id, grad, replay=replay)
    assert grad is None  # the first stage takes token ids: no input gradient
    return loss


def commit(runners: list[StageRunner], step: int, take: tuple[str, ...] = ()) -> list[int]:
    """Fold what each runner reports (and the held copies in `take`), then step each."""
    out = []
    for r in runners:
        fresh, held = r.report()
        r.fold(step, fresh=set(fresh), take=[mb for mb in take if mb in held])
        out.append(r.apply_step(step))
    return out


def keyed_grads(parts) -> dict[str, torch.Tensor]:
    return {f"{key}.{name}": p.grad.clone() for key, part in parts for name, p in part.named_parameters()}


def chain_grads(runners: list[StageRunner]) -> dict[str, torch.Tensor]:
    return {k: g for r in runners for k, g in keyed_grads(r.module.parts()).items()}


def chain_state(runners: list[StageRunner]) -> dict[str, torch.Tensor]:
    return {k: v for r in runners for k, v in stage_state_dict(r.module).items()}


def reference_grads(mbs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Gradients of the whole model, initialised as the reference run does, over one step of `mbs`."""
    net = build_model(GPT, CFG, device="meta")
    net.to_empty(device="cpu")
    net.reset_parameters(SEED)
    for x, y in mbs:
        (net(x, y) / len(mbs)).backward()
    return keyed_grads(net.parts())


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("bounds", [(0, 2, 4), (0, 1, 3, 4)])
@pytest.mark.parametrize("optimizer", [SGD, ADAMW], ids=["sgd", "adamw"])
def test_chained_stages_train_like_the_reference(text, bounds, optimizer):
    steps, M = 2, 3
    runners = make_runners(bounds, optimizer)
    data = batches(text)
    losses = []
    for step in range(steps):
        mbs = [next(data) for _ in range(M)]
        if step == 0:
            expected_grads = reference_grads(mbs)
        step_losses = [run_microbatch(runners, f"t:{step}:{n}", x, y, 1 / M) for n, (x, y) in enumerate(mbs)]
        losses.append(sum(step_losses) / M)
        if step == 0:
            assert_close(chain_grads(runners), expected_grads)
        assert all(r.num_committed == M and r.num_pending == 0 for r in runners)
        assert commit(runners, step) == [step + 1] * len(runners)
        assert all(not p.grad.any() for r in runners for p in r.params)

    ref = train_reference(
        model=GPT,
        model_config=CFG,
        seed=SEED,
        optimizer=optimizer,
        batches=batches(text),
        steps=steps,
        microbatches_per_step=M,
    )
    assert losses == pytest.approx(ref.losses, abs=1e-6)
    assert losses[1] < losses[0]  # it learns, so the comparison is not of two frozen models
    assert_close(chain_state(runners), ref.state)


def test_replayed_microbatch_adds_its_gradient_once(text):
    M = 3
    data = batches(text)
    mbs = [next(data) for _ in range(M)]
    once, replayed = make_runners((0, 2, 3, 4)), make_runners((0, 2, 3, 4))
    for n, (x, y) in enumerate(mbs):
        run_microbatch(once, f"t:0:{n}", x, y, 1 / M)

    run_microbatch(replayed, "t:0:0", *mbs[0], 1 / M)
    first, mid, last = replayed
    # A full replay, as after a lost reply.
    run_microbatch(replayed, "t:0:0", *mbs[0], 1 / M)
    # A replay of the last stage alone, and one whose middle hop failed and was dropped.
    h = mid.forward("t:0:0", first.forward("t:0:0", mbs[0][0]))
    last.forward_loss_backward("t:0:0", h, mbs[0][1], 1 / M)
    mid.drop("t:0:0")
    first.drop("t:0:0")
    assert all(r.num_pending == 0 for r in replayed)
    for n in (1, 2):
        run_microbatch(replayed, f"t:0:{n}", *mbs[n], 1 / M)
    run_microbatch(replayed, "t:0:2", *mbs[2], 1 / M)

    assert [r.num_committed for r in replayed] == [M] * 3
    torch.testing.assert_close(chain_grads(replayed), chain_grads(once), rtol=0, atol=0)
    before = chain_state(replayed)
    assert commit(replayed, 0) == [1, 1, 1]
    commit(once, 0)
    assert_close(chain_state(replayed), chain_state(once), atol=0)
    assert not all(torch.equal(before[k], v) for k, v in chain_state(replayed).items())


def test_a_replay_is_held_apart_and_counts_only_when_the_commit_takes_it(text):
    M = 2
    data = batches(text)
    mbs = [next(data) for _ in range(M)]
    once, held = make_runners((0, 2, 4)), make_runners((0, 2, 4))
    for n, (x, y) in enumerate(mbs):
        run_microbatch(once, f"t:0:{n}", x, y, 1 / M)
    run_microbatch(held, "t:0:0", *mbs[0], 1 / M)
    run_microbatch(held, "t:0:1", *mbs[1], 1 / M, replay=True)  # another replica may have it
    assert [r.report() for r in held] == [(frozenset({"t:0:0"}), frozenset({"t:0:1"}))] * 2
    assert not torch.equal(chain_grads(held)["head.lm_head.weight"], chain_grads(once)["head.lm_head.weight"])
    run_microbatch(held, "t:0:1", *mbs[1], 1 / M, replay=True)  # held already: adds nothing
    assert commit(held, 0, take=("t:0:1",)) == [1, 1]
    commit(once, 0)
    assert_close(chain_state(held), chain_state(once), atol=1e-6)


def test_held_copies_not_taken_are_discarded(text):
    data = batches(text)
    runners = make_runners((0, 2, 4))
    x, y = next(data)
    run_microbatch(runners, "t:0:0", x, y, 1.0, replay=True)
    before = chain_state(runners)
    assert commit(runners, 0, take=()) == [1, 1]  # another replica counted it
    assert_close(chain_state(runners), before, atol=0)  # zero gradients: SGD left the weights


def test_replay_returns_the_same_input_gradient(text):
    first, last = make_runners((0, 2, 4))
    x, y = next(batches(text))
    h = first.forward("t:0:0", x)
    loss_a, grad_a = last.forward_loss_backward("t:0:0", h, y, 0.5)
    loss_b, grad_b = last.forward_loss_backward("t:0:0", h, y, 0.5)
    assert loss_a == loss_b and grad_a.shape == (B, T, C)
    assert torch.equal(grad_a, grad_b)
    assert first.backward("t:0:0", grad_a) is None
    assert first.num_pending == 0 and first.num_committed == 1 and last.num_committed == 1


def test_fold_refuses_a_buffer_that_changed_and_a_closed_step_adds_nothing(text):
    runners = make_runners((0, 2, 4))
    data = batches(text)
    run_microbatch(runners, "t:0:0", *next(data), 1 / 2)
    for r in runners:
        with pytest.raises(
            RemoteError, match="holds gradients of 1 microbatches of step 0, the plan expects 2"
        ) as info:
            r.fold(0, fresh={"t:0:0", "t:0:1"}, take=[])
        assert info.value.retryable
        with pytest.raises(RemoteError, match="not folded"):
            r.apply_step(0)
        r.fold(0, fresh={"t:0:0"}, take=[])
    grads = chain_grads(runners)
    run_microbatch(runners, "t:0:1", *next(data), 1 / 2)  # a straggler after the fold
    torch.testing.assert_close(chain_grads(runners), grads, rtol=0, atol=0)
    assert [r.apply_step(0) for r in runners] == [1, 1]


def test_repeated_apply_step_is_idempotent_and_a_wrong_step_raises(text):
    runners = make_runners((0, 2, 4))
    data = batches(text)
    for r in runners:
        with pytest.raises(RemoteError, match="this stage is at step 0, not 1") as info:
            r.apply_step(1)
        assert info.value.retryable is False
        with pytest.raises(RemoteError, match="at step 0, not -1"):
            r.apply_step(-1)  # no step has been applied yet, so this is no repeat
    run_microbatch(runners, "t:0:0", *next(data), 1.0)
    assert commit(runners, 0) == [1, 1]
    after = chain_state(runners)
    for _ in range(2):
        assert [r.apply_step(0) for r in runners] == [1, 1]
    assert [(r.step, r.steps_applied) for r in runners] == [(1, 1), (1, 1)]
    assert_close(chain_state(runners), after, atol=0)
    for r in runners:
        with pytest.raises(RemoteError, match="at step 1, not 3"):
            r.apply_step(3)
    # Once gradients of the next step are held, the old step is no longer answered as a repeat.
    run_microbatch(runners, "t:1:0", *next(data), 1.0)
    with pytest.raises(RemoteError, match="at step 1, not 0"):
        runners[0].apply_step(0)
    assert commit(runners, 1) == [2, 2]


def test_non_finite_loss_or_gradient_is_refused_and_adds_nothing(text):
    first, mid, last = make_runners((0, 1, 3, 4))
    x, y = next(batches(text))
    h = mid.forward("t:0:0", first.forward("t:0:0", x))
    with pytest.raises(RemoteError, match="non-finite loss") as info:
        last.forward_loss_backward("t:0:0", torch.full_like(h, float("nan")), y, 1.0)
    assert not info.value.retryable
    with pytest.raises(RemoteError, match="non-finite input gradient"):
        mid.backward("t:0:0", torch.full_like(h, float("inf")))
    assert mid.report() == last.report() == (frozenset(), frozenset())
    assert all(not p.grad.any() for r in (mid, last) for p in r.params)


def test_param_digest_tells_identical_replicas_apart_from_different_ones(text):
    a, b = make_runners((0, 4)), make_runners((0, 4))
    assert a[0].param_digest() == b[0].param_digest()
    run_microbatch(a, "t:0:0", *next(batches(text)), 1.0)
    commit(a, 0)
    assert a[0].param_digest() != b[0].param_digest()


def test_check_inputs_rejects_bad_tensors():
    first, mid, last = make_runners((0, 1, 3, 4))
    tokens, targets = torch.zeros(B, T, dtype=torch.int64), torch.zeros(B, T, dtype=torch.int64)
    act = torch.zeros(B, T, C)
    first.check_inputs(tokens, targets)
    first.check_inputs(tokens[:1], targets[:1])  # a short batch is fine
    mid.check_inputs(act, None)
    last.check_inputs(act, targets)
    cases = [
        (
            first,
            tokens.float(),
            targets,
            r"tensor 'x' has dtype torch.float32, this stage expects torch.int64",
        ),
        (first, tokens.int(), targets, "has dtype torch.int32"),
        (mid, act.half(), None, r"tensor 'x' has dtype torch.float16, this stage expects torch.float32"),
        (
            first,
            torch.zeros(B, T + 1, dtype=torch.int64),
            targets,
            r"has shape \(2, 17\), this stage expects \('B', 16\)",
        ),
        (
            first,
            torch.zeros(B * T, dtype=torch.int64),
            targets,
            r"has shape \(32,\), this stage expects \('B', 16\)",
        ),
        (mid, torch.zeros(B, T, C + 1), None, r"has shape \(2, 16, 33\), this stage expects \('B', 16, 32\)"),
        (mid, torch.zeros(B, T), None, r"tensor 'x' has shape \(2, 16\)"),
        (
            first,
            torch.zeros(B + 1, T, dtype=torch.int64),
            targets,
            r"tensor 'x' has batch 3, this run allows 1\.\.2",
        ),
        (mid, torch.zeros(0, T, C), None, r"has batch 0, this run allows 1\.\.2"),
        (last, act, targets.float(), r"tensor 'targets' has dtype torch.float32"),
        (last, act, torch.zeros(B, T + 1, dtype=torch.int64), r"tensor 'targets' has shape \(2, 17\)"),
        (last, act, torch.zeros(B + 1, T, dtype=torch.int64), "tensor 'targets' has batch 3"),
        (last, act[:1], targets, "targets have batch 2 but x has batch 1"),
        (first, tokens, targets[:1], "targets have batch 1 but x has batch 2"),
    ]
    for runner, x, y, match in cases:
        with pytest.raises(BadFrameError, match=match):
            runner.check_inputs(x, y)


def test_backward_of_an_unknown_or_dropped_microbatch_raises(text):
    first, last = make_runners((0, 2, 4))
    x, y = next(batches(text))
    with pytest.raises(
        RemoteError, match=r"no forward state for microbatch t:0:9 \(it was dropped or never ran\)"
    ):
        first.backward("t:0:9", torch.zeros(B, T, C))
    h = first.forward("t:0:0", x)
    first.drop("t:0:0")
    with pytest.raises(RemoteError, match="no forward state for microbatch t:0:0"):
        first.backward("t:0:0", torch.zeros_like(h))
    # Backward consumes the forward state: a second backward without a new forward is refused.
    _, grad = last.forward_loss_backward("t:0:1", first.forward("t:0:1", x), y, 1.0)
    first.backward("t:0:1", grad)
    with pytest.raises(RemoteError, match="no forward state for microbatch t:0:1"):
        first.backward("t:0:1", grad)
    assert first.num_committed == 1


def test_gradient_of_the_wrong_shape_or_dtype_raises(text):
    first, mid, _last = make_runners((0, 1, 3, 4))
    x, _ = next(batches(text))
    cases = [
        (torch.zeros(1, T, C), r"gradient has shape \(1, 16, 32\), the output had \(2, 16, 32\)"),
        (
            torch.zeros(B, T, C + 1),
            r"tensor 'grad' has shape \(2, 16, 33\), this stage expects \('B', 16, 32\)",
        ),
        (torch.zeros(B, T), r"tensor 'grad' has shape \(2, 16\)"),
        (torch.zeros(B, T, C, dtype=torch.float16), "tensor 'grad' has dtype torch.float16"),
        (torch.zeros(B + 1, T, C), "tensor 'grad' has batch 3"),
    ]
    for n, (grad, match) in enumerate(cases):
        h = first.forward(f"t:0:{n}", x)
        mid.forward(f"t:0:{n}", h)
        with pytest.raises(BadFrameError, match=match):
            mid.backward(f"t:0:{n}", grad)
        with pytest.raises(BadFrameError, match=match):
            first.backward(f"t:0:{n}", grad)
    assert mid.num_committed == 0 and first.num_committed == 0
    assert all(not p.grad.any() for r in (first, mid) for p in r.params)
