"""The rollout protocol in one process: request and reply messages (a malformed reply names what
is wrong) and a rollout worker's answers (refusals, versions, the policy copy it samples with,
seeded sampling)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmtrain.errors import BadFrameError, Cause
from swarmtrain.model import build_model
from swarmtrain.rl.registry import build_task
from swarmtrain.rl.worker import RolloutWorker
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.rollout_messages import (
    RolloutReply,
    RolloutRequest,
    decode_prompts,
    decode_reply,
    encode_completions,
    encode_prompts,
)

MODEL = {"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 16}
RUN = "rl"
TRAINER = "trainer"
TASK = build_task("add")  # '12+34=' -> '46\n': prompts of <= 6 tokens, completions of <= 4
G = 4
PROMPTS = ["12+34=", "7+8="]


def policy(seed: int = 0):
    torch.manual_seed(seed)
    return build_model("tiny-gpt", MODEL, device="cpu")


def always(token: str, like) -> dict[str, torch.Tensor]:
    """A state for `like`'s architecture that emits `token` at every position: the final norm
    outputs ones whatever its input, and only `token`'s row of the head sees them."""
    state = {k: v.clone() for k, v in like.state_dict().items()}
    state["head.ln_f.weight"].zero_()
    state["head.ln_f.bias"].fill_(1.0)
    head = state["head.lm_head.weight"]  # (V, C)
    head.zero_()
    head[ord(token)] = 100.0
    return state


def make_worker(*, version: int = 0, strikes: list | None = None) -> RolloutWorker:
    model, spare = policy(), policy()
    return RolloutWorker(
        run_id=RUN,
        model=model,
        spare=spare,
        task=TASK,
        temperature=1.0,
        authorized=lambda peer: peer == TRAINER,
        strike=(lambda peer, why: strikes.append((peer, why)))
        if strikes is not None
        else (lambda p, w: None),
        version=version,
    )


def request(prompts=PROMPTS, *, run_id=RUN, kind="rollout", **fields) -> Frame:
    meta = RolloutRequest(samples_per_prompt=G, max_new_tokens=TASK.max_new_tokens, **fields).to_meta()
    tok = TASK.tokenizer
    return Frame(
        kind=kind, run_id=run_id, tensors=encode_prompts([tok.encode(p) for p in prompts]), meta=meta
    )


def ask(worker: RolloutWorker, frame: Frame, caller: str = TRAINER) -> Frame:
    return asyncio.run(worker.handle(frame, caller))


def decoded(reply: Frame, *, rows: int = len(PROMPTS) * G, newest_version: int = 100):
    return decode_reply(
        reply.meta,
        reply.tensors,
        rows=rows,
        max_new_tokens=TASK.max_new_tokens,
        vocab_size=TASK.tokenizer.vocab_size,
        newest_version=newest_version,
    )


def texts(reply: Frame) -> list[str]:
    return [TASK.tokenizer.decode(list(t)) for t in decoded(reply).tokens]


# messages


def test_prompts_round_trip_right_padded():
    prompts = [[1, 2, 3], [4], [5, 6]]
    tensors = encode_prompts(prompts)
    assert tensors["prompts"].tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]]
    assert tensors["prompt_lengths"].tolist() == [3, 1, 2]
    assert decode_prompts(tensors, vocab_size=256, max_len=3) == prompts


@pytest.mark.parametrize(
    "change, names",
    [
        (lambda t: t.pop("prompt_lengths"), "tensors must be exactly"),
        (lambda t: t.update(extra=torch.zeros(1)), "tensors must be exactly"),
        (lambda t: t.update(prompts=t["prompts"].int()), "prompts must be"),
        (lambda t: t.update(prompts=t["prompts"][0]), "prompts must be"),
        (lambda t: t.update(prompt_lengths=t["prompt_lengths"][:1]), "prompt_lengths must be"),
        (lambda t: t.update(prompt_lengths=torch.tensor([0, 1])), "every prompt must have 1..3 tokens"),
        (lambda t: t.update(prompt_lengths=torch.tensor([4, 1])), "every prompt must have 1..3 tokens"),
        (lambda t: t["prompts"].__setitem__((0, 0), 256), "prompt token ids must be in [0, 256)"),
        (lambda t: t["prompts"].__setitem__((0, 0), -1), "prompt token ids must be in [0, 256)"),
    ],
)
def test_malformed_prompts_are_refused_naming_what_is_wrong(change, names):
    tensors = encode_prompts([[1, 2, 3], [4]])
    change(tensors)
    with pytest.raises(BadFrameError, match="rollout request") as e:
        decode_prompts(tensors, vocab_size=256, max_len=10)
    assert names in str(e.value)


def test_a_prompt_longer_than_the_worker_takes_is_refused():
    with pytest.raises(BadFrameError, match=r"1\.\.2 tokens"):
        decode_prompts(encode_prompts([[1, 2, 3]]), vocab_size=256, max_len=2)


def test_request_meta_round_trips_and_names_a_bad_field():
    r = RolloutRequest(samples_per_prompt=4, max_new_tokens=3, min_version=7, seed=11)
    assert RolloutRequest.from_meta(r.to_meta()) == r
    with pytest.raises(BadFrameError, match="samples_per_prompt"):
        RolloutRequest.from_meta(r.to_meta() | {"samples_per_prompt": 0})
    with pytest.raises(BadFrameError, match="min_version"):
        RolloutRequest.from_meta(r.to_meta() | {"min_version": -1})


def reply_parts(version: int = 2) -> tuple[dict, dict[str, torch.Tensor]]:
    """A well-formed reply for 2 rows of completions, at most 3 tokens each."""
    tensors = encode_completions([(1, 2, 3), (4,)], [(-0.5, -1.0, 0.0), (-2.0,)], [1.0, 0.0], width=3)
    return RolloutReply(version=version).to_meta(), tensors


def decode_parts(meta, tensors, *, newest_version: int = 5):
    return decode_reply(
        meta, tensors, rows=2, max_new_tokens=3, vocab_size=256, newest_version=newest_version
    )


def test_a_well_formed_reply_round_trips():
    got = decode_parts(*reply_parts())
    assert got.version == 2
    assert got.tokens == [(1, 2, 3), (4,)]
    assert got.logprobs == [(-0.5, -1.0, 0.0), (-2.0,)]
    assert got.rewards == [1.0, 0.0]


def _set(name, value):
    return lambda meta, t: t.update({name: value(t[name])})


def _poke(name, index, value):
    return lambda meta, t: t[name].__setitem__(index, value)


@pytest.mark.parametrize(
    "change, names",
    [
        # the meta
        (lambda meta, t: meta.update(version=6), "policy version 6, but the swarm has served only up to 5"),
        (lambda meta, t: meta.update(version=-1), "'version'"),
        (lambda meta, t: meta.update(version="2"), "'version'"),
        (lambda meta, t: meta.pop("version"), "version"),
        (lambda meta, t: meta.update(extra=1), "extra"),
        # which tensors
        (lambda meta, t: t.pop("rewards"), "tensors must be exactly"),
        (lambda meta, t: t.update(more=torch.zeros(2)), "tensors must be exactly"),
        # shapes and dtypes
        (_set("completions", lambda c: c.int()), "completions must be (2, <= 3) int64"),
        (_set("completions", lambda c: c[:1]), "completions must be (2, <= 3) int64"),
        (_set("completions", lambda c: c[0]), "completions must be (2, <= 3) int64"),
        (_set("completions", lambda c: torch.zeros(2, 4, dtype=torch.int64)), "completions must be"),
        (_set("completions", lambda c: torch.zeros(2, 0, dtype=torch.int64)), "completions must be"),
        (_set("logprobs", lambda lp: lp.double()), "logprobs must be float32 shaped like completions"),
        (_set("logprobs", lambda lp: lp[:, :2]), "logprobs must be float32 shaped like completions"),
        (_set("lengths", lambda n: n[:1]), "lengths must be (2,) int64"),
        (_set("lengths", lambda n: n.float()), "lengths must be (2,) int64"),
        (_set("rewards", lambda r: r[:1]), "rewards must be (2,) float32"),
        (_set("rewards", lambda r: r.double()), "rewards must be (2,) float32"),
        # values
        (_poke("lengths", 1, 0), "lengths must be in 1..3"),
        (_poke("lengths", 0, 4), "lengths must be in 1..3"),
        (_poke("completions", (0, 1), 256), "completions must hold token ids in [0, 256)"),
        (_poke("completions", (1, 0), -1), "completions must hold token ids in [0, 256)"),
        (_poke("logprobs", (0, 0), float("nan")), "logprobs must be finite and <= 0"),
        (_poke("logprobs", (0, 0), float("-inf")), "logprobs must be finite and <= 0"),
        (_poke("logprobs", (1, 0), 0.5), "logprobs must be finite and <= 0"),
        (_poke("rewards", 0, float("nan")), "rewards must be finite"),
        (_poke("rewards", 1, float("inf")), "rewards must be finite"),
    ],
    ids=[
        *("version-too-new", "version-negative", "version-str", "version-missing", "meta-extra"),
        *("tensor-missing", "tensor-extra"),
        *(
            "completions-int32",
            "completions-rows",
            "completions-1d",
            "completions-too-wide",
            "completions-empty",
        ),
        *(
            "logprobs-float64",
            "logprobs-shape",
            "lengths-shape",
            "lengths-float",
            "rewards-shape",
            "rewards-float64",
        ),
        *("length-0", "length-past-width", "token-256", "token-negative"),
        *("logprob-nan", "logprob-minus-inf", "logprob-positive", "reward-nan", "reward-inf"),
    ],
)
def test_a_malformed_reply_is_refused_naming_the_bad_field(change, names):
    meta, tensors = reply_parts()
    change(meta, tensors)
    with pytest.raises(BadFrameError) as e:
        decode_parts(meta, tensors)
    assert names in str(e.value)


# the worker


def test_a_request_is_answered_with_checked_completions_of_the_active_version():
    worker = make_worker(version=3)
    reply = ask(worker, request(seed=1))
    assert reply.kind == "rollout_data" and reply.run_id == RUN and reply.step == 3
    got = decoded(reply, newest_version=3)
    assert got.version == 3
    assert len(got.tokens) == len(PROMPTS) * G
    assert all(1 <= len(t) <= TASK.max_new_tokens for t in got.tokens)
    assert all(len(lp) == len(t) and all(x <= 0 for x in lp) for t, lp in zip(got.tokens, got.logprobs))
    completions = texts(reply)
    # row i answers prompt i // G, and its claimed reward is the task's
    assert got.rewards == [TASK.reward(PROMPTS[i // G], c) for i, c in enumerate(completions)]
    assert worker.stats.requests == 1 and worker.stats.samples == len(PROMPTS) * G
    assert worker.stats.refused == 0


def test_the_seed_makes_sampling_deterministic():
    a, b = make_worker(), make_worker()
    first, again, other = ask(a, request(seed=5)), ask(b, request(seed=5)), ask(a, request(seed=6))
    assert texts(first) == texts(again)
    assert torch.equal(first.tensors["logprobs"], again.tensors["logprobs"])
    assert texts(first) != texts(other)


def test_install_swaps_in_the_new_version_and_its_weights():
    worker = make_worker()
    before = texts(ask(worker, request(seed=2)))
    assert not all(c == "7777" for c in before)

    worker.install(always("7", policy()), 4, wire_bytes=123)
    reply = ask(worker, request(seed=2))
    assert reply.step == 4 and decoded(reply).version == 4
    assert texts(reply) == ["7777"] * (len(PROMPTS) * G)  # no end marker: the whole budget
    assert decoded(reply).rewards == [0.0] * (len(PROMPTS) * G)
    assert all(lp == 0.0 for row in decoded(reply).logprobs for lp in row)  # it is sure

    # the copy that sampled version 0 takes version 5 (version 0's weights again)
    worker.install(policy().state_dict(), 5)
    reply = ask(worker, request(seed=2))
    assert decoded(reply).version == 5 and texts(reply) == before
    assert worker.stats.versions_taken == 2 and worker.stats.update_bytes == 123


def test_install_overwrites_only_the_spare_copy():
    worker = make_worker()
    active = worker._active
    worker.install(always("7", policy()), 1)
    assert worker._active is not active and worker._spare is active
    assert not torch.equal(
        active.state_dict()["head.lm_head.weight"], worker._active.state_dict()["head.lm_head.weight"]
    )


def test_a_ping_is_answered_with_the_version():
    reply = ask(make_worker(version=7), Frame(kind="ping", run_id=RUN))
    assert reply.kind == "pong" and reply.step == 7


def bad_tokens(frame: Frame) -> Frame:
    frame.tensors["prompts"][0, 0] = 300
    return frame


def too_many_new_tokens(frame: Frame) -> Frame:
    frame.meta["max_new_tokens"] = TASK.max_new_tokens + 1
    return frame


@pytest.mark.parametrize(
    "frame, caller, cause, says, struck",
    [
        (request(run_id="other"), TRAINER, Cause.WRONG_RUN, "serves run 'rl', not 'other'", False),
        (request(kind="forward"), TRAINER, Cause.BAD_FRAME, "not 'forward'", False),
        (request(), "stranger", Cause.UNAUTHORIZED, "does not let stranger drive it", False),
        (bad_tokens(request()), TRAINER, Cause.BAD_FRAME, "prompt token ids", True),
        (too_many_new_tokens(request()), TRAINER, Cause.BAD_FRAME, "max_new_tokens 5", True),
        (
            Frame(kind="rollout", run_id=RUN, meta={"samples_per_prompt": G}),
            TRAINER,
            Cause.BAD_FRAME,
            "max_new_tokens",
            True,
        ),
        (
            Frame(kind="rollout", run_id=RUN, meta=request().meta),
            TRAINER,
            Cause.BAD_FRAME,
            "tensors must be exactly",
            True,
        ),
        (request(min_version=2), TRAINER, Cause.WRONG_STEP, "holds policy version 1, behind the 2", False),
    ],
    ids=[
        "other-run",
        "wrong-kind",
        "unauthorized",
        "bad-token",
        "too-long",
        "no-meta",
        "no-tensors",
        "behind",
    ],
)
def test_a_request_is_refused_without_sampling(frame, caller, cause, says, struck):
    strikes = []
    worker = make_worker(version=1, strikes=strikes)
    reply = ask(worker, frame, caller)
    assert reply.kind == "error" and reply.error_cause() == cause
    assert says in reply.error_text()
    assert worker.stats.refused == 1 and worker.stats.requests == 0 and worker.stats.samples == 0
    assert [peer for peer, _ in strikes] == ([caller] if struck else [])


def test_a_worker_behind_serves_once_it_installs_the_version_asked_for():
    worker = make_worker(version=0)
    assert ask(worker, request(min_version=3)).error_cause() == Cause.WRONG_STEP
    worker.install(policy().state_dict(), 3)
    reply = ask(worker, request(min_version=3))
    assert reply.kind == "rollout_data" and decoded(reply).version == 3


def test_a_request_naming_a_newer_version_wakes_the_peer_to_fetch_it():
    worker = make_worker(version=3)
    woken = []
    worker.on_wanted = lambda: woken.append(worker.wanted)
    ask(worker, request(seed=1, min_version=2, latest_version=5))  # served by version 3
    ask(worker, request(seed=1, min_version=2, latest_version=5))  # nothing new: no wake-up
    ask(worker, request(seed=1, min_version=3, latest_version=6))
    assert woken == [5, 6] and worker.wanted == 6
    assert worker.stats.requests == 3
