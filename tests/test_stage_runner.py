"""StageRunner without networking: stages chained by hand train exactly like one model, a
replayed microbatch adds its gradient once, and a step goes through only on complete gradients."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.errors import BadFrameError, RemoteError
from swarmtrain.model import build_model, build_stage
from swarmtrain.train.data import TokenBatches, loss_inputs_of, stdlib_text
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


def make_runners(
    bounds: tuple[int, ...], optimizer: OptimizerConfig = SGD, *, loss: str | None = None
) -> list[StageRunner]:
    return [
        StageRunner(
            build_stage(GPT, CFG, a, b, num_blocks=4, seed=SEED, loss=loss), optimizer, microbatch_size=B
        )
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]


def run_microbatch(
    runners: list[StageRunner], mb_id: str, x, y, loss_scale: float, *, replay: bool = False
) -> float:
    """Forward through every stage, loss and backward on the last, backward back to the first."""
    h, inputs = loss_inputs_of((x, y))  # y: targets, or {name: tensor}
    for runner in runners[:-1]:
        runner.check_inputs(h, inputs)
        h = runner.forward(mb_id, h)
    runners[-1].check_inputs(h, inputs)
    loss, grad = runners[-1].forward_loss_backward(mb_id, h, inputs, loss_scale, replay=replay)
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


def reference_grads(mbs: list[tuple], loss: str | None = None) -> dict[str, torch.Tensor]:
    """Gradients of the whole model, initialised as the reference run does, over one step of
    `mbs` ((x, targets) or (x, {name: tensor})) under `loss` (None: the model's own)."""
    net = build_model(GPT, CFG, device="meta")
    net.to_empty(device="cpu")
    net.reset_parameters(SEED)
    for x, y in mbs:
        value = net(x, y) if loss is None else net.resolve_loss(loss)(net(x), y)
        (value / len(mbs)).backward()
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
    last.forward_loss_backward("t:0:0", h, {"targets": mbs[0][1]}, 1 / M)
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
    loss_a, grad_a = last.forward_loss_backward("t:0:0", h, {"targets": y}, 0.5)
    loss_b, grad_b = last.forward_loss_backward("t:0:0", h, {"targets": y}, 0.5)
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
        last.forward_loss_backward("t:0:0", torch.full_like(h, float("nan")), {"targets": y}, 1.0)
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
    first.check_inputs(tokens, {"targets": targets})
    first.check_inputs(tokens[:1], {"targets": targets[:1]})  # a short batch is fine
    mid.check_inputs(act, {"targets": targets})  # a middle stage checks the loss inputs it passes on
    last.check_inputs(act, {"targets": targets})
    cases = [
        (
            first,
            tokens.float(),
            targets,
            r"tensor 'x' has dtype torch.float32, this stage expects torch.int64",
        ),
        (first, tokens.int(), targets, "has dtype torch.int32"),
        (mid, act.half(), targets, r"tensor 'x' has dtype torch.float16, this stage expects torch.float32"),
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
        (
            mid,
            torch.zeros(B, T, C + 1),
            targets,
            r"has shape \(2, 16, 33\), this stage expects \('B', 16, 32\)",
        ),
        (mid, torch.zeros(B, T), targets, r"tensor 'x' has shape \(2, 16\)"),
        (
            first,
            torch.zeros(B + 1, T, dtype=torch.int64),
            targets,
            r"tensor 'x' has batch 3, this run allows 1\.\.2",
        ),
        (mid, torch.zeros(0, T, C), targets, r"has batch 0, this run allows 1\.\.2"),
        (last, act, targets.float(), r"tensor 'targets' has dtype torch.float32"),
        (last, act, torch.zeros(B, T + 1, dtype=torch.int64), r"tensor 'targets' has shape \(2, 17\)"),
        (last, act, torch.zeros(B + 1, T, dtype=torch.int64), "tensor 'targets' has batch 3"),
        (last, act[:1], targets, "loss input 'targets' has batch 2 but x has batch 1"),
        (first, tokens, targets[:1], "loss input 'targets' has batch 1 but x has batch 2"),
        (mid, act, targets[:1], "loss input 'targets' has batch 1 but x has batch 2"),
    ]
    for runner, x, y, match in cases:
        with pytest.raises(BadFrameError, match=match):
            runner.check_inputs(x, {"targets": y})


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
    _, grad = last.forward_loss_backward("t:0:1", first.forward("t:0:1", x), {"targets": y}, 1.0)
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


def weighted(x: torch.Tensor, y: torch.Tensor, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(x, named inputs) for weighted_cross_entropy: non-trivial weights in [0, 2), a quarter of them 0."""
    gen = torch.Generator().manual_seed(seed)
    w = 2 * torch.rand(y.shape, generator=gen)  # (B, T)
    w[torch.rand(y.shape, generator=gen) < 0.25] = 0.0
    return x, {"targets": y, "weights": w}


@pytest.mark.parametrize("loss", [None, "cross_entropy", "weighted_cross_entropy"])
def test_named_inputs_through_two_stages_match_the_single_process_model(text, loss):
    """One step of named microbatches through a 2-stage split: the same losses, bit for bit,
    and the same gradients as the whole model computing the same loss."""
    M = 2  # a loss_scale of 1/2 is exact, so the sums can match bit for bit
    data = batches(text)
    mbs = [next(data) for _ in range(M)]
    if loss == "weighted_cross_entropy":
        mbs = [weighted(x, y, seed=n) for n, (x, y) in enumerate(mbs)]
    else:
        mbs = [(x, {"targets": y}) for x, y in mbs]
    runners = make_runners((0, 2, 4), loss=loss)
    losses = [run_microbatch(runners, f"t:0:{n}", x, inputs, 1 / M) for n, (x, inputs) in enumerate(mbs)]

    net = build_model(GPT, CFG, device="meta")
    net.to_empty(device="cpu")
    net.reset_parameters(SEED)
    expected = [net.resolve_loss(loss)(net(x), inputs).item() for x, inputs in mbs]
    assert losses == expected
    assert_close(chain_grads(runners), reference_grads(mbs, loss), atol=0)
    assert all(r.num_committed == M for r in runners)
    # The weighted loss is not the plain one in disguise: its weights change loss and gradients.
    if loss == "weighted_cross_entropy":
        plain = [net(x, inputs["targets"]).item() for x, inputs in mbs]
        assert all(abs(a - b) > 1e-3 for a, b in zip(losses, plain, strict=True))


def test_a_loss_input_is_checked_by_name_shape_dtype_batch_and_finiteness(text):
    """Every stage refuses a microbatch whose named inputs do not fit the run's loss, before any compute."""
    first, mid, last = make_runners((0, 1, 3, 4), loss="weighted_cross_entropy")
    x, inputs = weighted(*next(batches(text)), seed=0)
    act = torch.zeros(B, T, C)
    good = [(first, x), (mid, act), (last, act)]
    for runner, h in good:
        runner.check_inputs(h, inputs)
    w, y = inputs["weights"], inputs["targets"]
    takes = r"loss 'weighted_cross_entropy' takes 'targets', 'weights'"
    nan, inf = w.clone(), w.clone()
    nan[1, 3], inf[0, 0] = float("nan"), float("-inf")
    cases = [
        ({"targets": y}, rf"^missing loss input 'weights': {takes}; give each microbatch as \(inputs, \{{name: tensor\}}\) with these names$"),
        ({}, rf"missing loss input 'targets', 'weights': {takes}"),
        (inputs | {"mask": w}, rf"^unknown loss input 'mask': {takes}"),
        ({"targets": y, "weight": w}, rf"missing loss input 'weights'; unknown loss input 'weight': {takes}"),
        (inputs | {"weights": w[:, :-1]}, r"tensor 'weights' has shape \(2, 15\), this stage expects \('B', 16\)"),
        (inputs | {"weights": w.double()}, "tensor 'weights' has dtype torch.float64, this stage expects torch.float32"),
        (inputs | {"weights": w.long()}, "tensor 'weights' has dtype torch.int64, this stage expects torch.float32"),
        (inputs | {"targets": y.int()}, "tensor 'targets' has dtype torch.int32, this stage expects torch.int64"),
        (inputs | {"weights": w[:1]}, "loss input 'weights' has batch 1 but x has batch 2"),
        (inputs | {"weights": nan}, "loss input 'weights' holds NaN or inf values"),
        (inputs | {"weights": inf}, "loss input 'weights' holds NaN or inf values"),
        (inputs | {"weights": w.tolist()}, "loss input 'weights' is a list, not a tensor"),
    ]  # fmt: skip
    for runner, h in good:
        for bad, match in cases:
            with pytest.raises(BadFrameError, match=match):
                runner.check_inputs(h, bad)
    # The default loss takes 'targets' alone.
    plain = make_runners((0, 4))[0]
    with pytest.raises(
        BadFrameError, match=r"unknown loss input 'weights': loss 'cross_entropy' takes 'targets'"
    ):
        plain.check_inputs(x, inputs)


def test_non_finite_weights_that_skip_the_check_are_refused_and_add_nothing(text):
    first, last = make_runners((0, 2, 4), loss="weighted_cross_entropy")
    x, inputs = weighted(*next(batches(text)), seed=0)
    inputs["weights"][0, 0] = float("nan")
    with pytest.raises(RemoteError, match="non-finite loss") as info:
        last.forward_loss_backward("t:0:0", first.forward("t:0:0", x), inputs, 1.0)
    assert not info.value.retryable
    assert last.report() == (frozenset(), frozenset())
    assert all(not p.grad.any() for p in last.params)
