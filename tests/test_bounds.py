"""Norm bounds, own-gradient checks and the guarded optimizer step, without networking:
`NormBound` on plain floats, then a `StageRunner` refusing absurd values of its own."""

from __future__ import annotations

import math

import pytest
import torch

from swarmtrain.errors import BadFrameError, Cause, RemoteError
from swarmtrain.train.bounds import BoundsConfig, NormBound, admit_frame, tensor_norm
from swarmtrain.train.data import stdlib_text
from swarmtrain.train.optim import StepGuard
from swarmtrain.train.stage_runner import StageRunner
from tests.test_stage_runner import ADAMW, batches, make_runners, run_microbatch

CFG = BoundsConfig(window=5, warmup=3, factor=10.0, max_rms=1e3)


@pytest.fixture(scope="module")
def text() -> bytes:
    return stdlib_text(max_bytes=2**20)


def test_the_absolute_cap_refuses_from_the_first_value_and_records_nothing():
    bound = NormBound(CFG)
    assert "RMS 2e+03 exceeds the cap 1e+03" in bound.admit(2e3 * 2, 4)
    assert "not finite" in bound.admit(math.inf, 4)
    assert "not finite" in bound.admit(math.nan, 4)
    assert bound.admit(1e3 * 2, 4) is None  # RMS exactly at the cap passes
    assert list(bound._norms) == [2e3]


def test_the_relative_bound_applies_after_the_warm_up_and_refused_values_do_not_move_it():
    bound = NormBound(CFG)
    assert [bound.admit(n, 1) for n in (1.0, 50.0)] == [None, None]  # warm-up: no relative bound
    assert bound.median is None
    assert bound.admit(2.0, 1) is None
    assert bound.median == 2.0  # median of 1, 2, 50
    for _ in range(10):  # a flood of out-of-bounds values: each refused, none recorded
        assert "exceeds 10 x the recent median 2" in bound.admit(21.0, 1)
    assert bound.median == 2.0
    assert bound.admit(20.0, 1) is None  # factor x median is still allowed


def test_the_median_follows_the_last_window_values():
    bound = NormBound(CFG)
    for n in (1.0, 1.0, 1.0, 1.0, 1.0):
        assert bound.admit(n, 1) is None
    assert bound.admit(100.0, 1) is not None
    for n in (5.0, 9.0, 9.0, 9.0, 9.0):  # a healthy drift, each step within the factor
        assert bound.admit(n, 1) is None
    assert bound.median == 9.0
    assert bound.admit(89.0, 1) is None  # 100 was refused against 1; now it is within 10 x 9


def test_zero_norms_are_accepted_without_being_recorded():
    bound = NormBound(CFG)
    for n in (0.0, 0.0, 0.0, 0.0):
        assert bound.admit(n, 8) is None
    assert bound.median is None  # a replica that summed nothing says nothing about scale
    assert bound.admit(1e6, 1) is not None  # the cap still holds


def test_the_residue_of_steps_without_work_does_not_set_the_median():
    """A replica with no microbatches still sends its error-feedback residue through a lossy
    codec (CI saw a norm of 3e-10 over a stage's gradients); ten such steps, then real work."""
    bound = NormBound(CFG)
    numel = 30_000
    for _ in range(10):
        assert bound.admit(3e-10, numel) is None
    assert bound.median is None
    assert [bound.admit(n, numel) for n in (0.17, 0.2, 0.15)] == [None, None, None]
    assert bound.median == 0.17
    assert bound.admit(3e-10, numel) is None and bound.median == 0.17  # the residue moves nothing


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"window": 0}, "window >= 1.*window=0"),
        ({"window": 4, "warmup": 5}, "warmup <= window.*warmup=5"),
        ({"factor": 1.0}, "factor must be .* above 1, got 1.0"),
        ({"grad_factor": 0.5}, "grad_factor must be .* above 1, got 0.5"),
        ({"factor": math.inf}, "factor must be a finite"),
        ({"max_rms": 0.0}, "max_rms must be a finite positive number, got 0.0"),
    ],
)
def test_config_is_validated_with_the_numbers(kw, match):
    with pytest.raises(ValueError, match=match):
        BoundsConfig(**kw)


def test_tensor_norm_of_a_list_is_the_norm_of_their_concatenation_and_absurd_values_are_refused():
    a, b = torch.randn(3, 4), torch.randn(5, dtype=torch.bfloat16)
    norm, numel = tensor_norm([a, b])
    assert numel == 17
    assert norm == pytest.approx(float(torch.cat([a.flatten(), b.float()]).norm()), rel=1e-5)
    assert tensor_norm([]) == (0.0, 0)
    with pytest.raises(BadFrameError, match="activations out of bounds"):
        admit_frame(NormBound(BoundsConfig()), tensor_norm(torch.full((4, 4), 1e30)), "activations")


# the stage's own gradients and its optimizer step


def test_own_parameter_gradients_out_of_bounds_are_refused_and_add_nothing_on_stage_0_too(text):
    first, last = make_runners((0, 2, 4))
    data = batches(text)
    for n in range(4):  # warm the param_grads bounds up with healthy microbatches
        run_microbatch([first, last], f"t:0:{n}", *next(data), 0.25)
    before = [p.grad.clone() for p in first.params]
    x, _ = next(data)
    cases = [(1e30, "not finite"), (1e3, "x the recent median")]  # absolute, then relative
    for n, (scale, why) in enumerate(cases):
        out = first.forward(f"t:0:x{n}", x)
        with pytest.raises(RemoteError, match=f"parameter gradients it refuses: .*{why}") as info:
            first.backward(f"t:0:x{n}", torch.full_like(out, scale))
        assert info.value.cause == Cause.REFUSED and not info.value.retryable
    assert first.num_committed == 4
    assert all(torch.equal(p.grad, g) for p, g in zip(first.params, before))


def export(runner: StageRunner) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in runner.export_state().items()}


def assert_state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_an_apply_with_gradients_too_large_to_square_is_refused_and_changes_nothing(text):
    (runner,) = make_runners((0, 4), ADAMW)
    data = batches(text)
    run_microbatch([runner], "t:0:0", *next(data), 1.0)
    runner.fold(0, fresh={"t:0:0"}, take=[])
    runner.apply_step(0)  # AdamW now has state to protect
    run_microbatch([runner], "t:1:0", *next(data), 1.0)
    runner.fold(1, fresh={"t:1:0"}, take=[])
    state = export(runner)
    with torch.no_grad():
        runner.params[0].grad[0] = 1e25  # planted in the accumulated sum
    planted = [p.grad.clone() for p in runner.params]
    with pytest.raises(RemoteError, match="refuses to apply step 1: its summed gradients have norm inf"):
        runner.apply_step(1)
    with pytest.raises(RemoteError, match="beyond what the optimizer can square"):
        runner.apply_step(1, [g / 1e10 for g in planted], grad_scale=1e10)  # the scale counts
    assert runner.step == 1
    assert_state_equal(export(runner), state)
    assert all(torch.equal(p.grad, g) for p, g in zip(runner.params, planted))  # nothing written
    with torch.no_grad():
        runner.params[0].grad[0] = 0.0
    assert runner.apply_step(1) == 2  # a sane total still steps
    assert not torch.equal(runner.params[1].detach(), state["param." + list(runner.named_params)[1]])


def test_a_step_that_would_leave_non_finite_state_is_undone_bit_for_bit(text):
    (runner,) = make_runners((0, 4), ADAMW)
    data = batches(text)
    run_microbatch([runner], "t:0:0", *next(data), 1.0)
    runner.fold(0, fresh={"t:0:0"}, take=[])
    runner.apply_step(0)
    run_microbatch([runner], "t:1:0", *next(data), 1.0)
    runner.fold(1, fresh={"t:1:0"}, take=[])
    first = runner.params[0]
    runner.optimizer.state[first]["exp_avg"].fill_(3e38)  # finite, but the update overflows
    runner.optimizer.state[first]["exp_avg_sq"].zero_()
    state = export(runner)
    with pytest.raises(RemoteError, match="would leave non-finite parameters or optimizer state") as info:
        runner.apply_step(1)
    assert info.value.cause == Cause.REFUSED
    assert runner.step == 1
    assert_state_equal(export(runner), state)


def test_the_step_guard_removes_state_a_refused_first_step_created():
    p = torch.nn.Parameter(torch.tensor([3e38, 1.0]))
    p.grad = torch.tensor([-1e38, 1.0])
    optimizer = torch.optim.SGD([p], lr=1.0, momentum=0.9)
    guard = StepGuard(optimizer)
    assert "non-finite" in guard.step()
    assert torch.equal(p.detach(), torch.tensor([3e38, 1.0])) and p not in optimizer.state
    p.grad = torch.tensor([1.0, 1.0])
    assert guard.step() is None
    assert torch.equal(p.detach(), torch.tensor([3e38 - 1.0, 0.0])) and p in optimizer.state
