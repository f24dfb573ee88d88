"""A score pass: one microbatch forward through the pipeline for the loss's per-sample scores.

The trainer sends the microbatch into stage 0 as a forward frame marked `ForwardMeta.score`,
by the same routing as training (`hop.Hop`: a replica that fails or dies is banned for a
while and the pass replayed on another). Every stage runs it forward only, on the parameters
of exactly the step the frame names, and keeps nothing; the last stage answers with the
run's loss's scores (`Loss.score`: GRPO's per-token log-probs of the taken tokens) instead of
a gradient. Nothing of it counts towards any step: no gradient, no commit, no microbatch in
any ledger. A replica at another step refuses the pass (WRONG_STEP, not retryable), so the
scores that come back are always those of `step`'s parameters.

The rollout feed checks rollout peers' behaviour log-probs with it (`swarmtrain.rl.verify`).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from swarmtrain.errors import BadFrameError, SwarmError
from swarmtrain.train.authority import microbatch_id
from swarmtrain.train.hop import Hop, HopFailedError
from swarmtrain.train.serving import SCORES, scores_check
from swarmtrain.train.step import next_epoch
from swarmtrain.train.trainer_context import TrainerContext
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.messages import ForwardMeta


class ScoreFailedError(SwarmError):
    """No replica chain completed the score pass within the attempts or the time allowed."""


async def score_pass(
    ctx: TrainerContext, step: int, x: torch.Tensor, loss_inputs: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The run's loss's scores of microbatch (`x`, `loss_inputs`) on the parameters of `step`:
    float32, shaped like loss_inputs['targets'].

    Raises RemoteError when the pass itself is refused (a stage is at another step, the loss
    has no score, the microbatch does not fit the run), ScoreFailedError when no replica
    completed it in time. Changes nothing on any stage but its routers' readiness figures.
    """
    targets = loss_inputs.get("targets")
    if targets is None:
        raise ValueError("a score pass scores the loss's 'targets': the microbatch names none")
    mb = microbatch_id(ctx.trainer_id, step, next_epoch(), 0)
    meta = ForwardMeta(loss_scale=1.0, budget_s=ctx.microbatch_timeout_s, score=True)
    check_scores = scores_check(tuple(targets.shape))

    def build(target: str, is_replay: bool, budget_s: float) -> Frame:
        return ctx.stage0_frame(mb, step, x, loss_inputs, replace(meta, budget_s=budget_s))

    def check(reply: Frame) -> None:
        if reply.step != step:
            raise BadFrameError(f"a score pass of step {step} was answered at step {reply.step}")
        check_scores(reply)

    hop = Hop(
        build=build,
        deadline=time.monotonic() + ctx.microbatch_timeout_s * (ctx.max_retries + 1),
        timeout_s=ctx.microbatch_timeout_s,
        max_attempts=ctx.max_retries + 1,
        route_len=ctx.num_stages,
        check=check,
    )
    try:
        done = await hop.send(ctx.stage0_hops())
    except HopFailedError as e:
        raise ScoreFailedError(f"score pass of step {step}: {e}") from None
    return done.reply.tensors[SCORES]
