"""The protocol: one microbatch's life and the step around it, working through small contexts.

Read in this order to follow a microbatch from the trainer to the last stage and back:
- `step`: `TrainerStep` sends a step's microbatches (input and named loss inputs) into stage 0,
  then commits every stage; `TrainerContext` is what it needs from the trainer around it.
- `hop`: `Hop`, the one choose / send / ban / replay loop every hop uses.
- `service`: `StageService`, a stage replica's request handler (every refusal with a cause).
- `serving`: `ForwardServer`, forward, the hop on, backward, and the `ReplayCache`.
- `commit`: `CommitParticipant`, a replica's side of prepare, exchange and apply.
- `context`: `StageContext`, all the serving side asks of the process around it.
Beside them: `stage_runner` (a stage's compute and optimizer state, no networking),
`bounds` (running norm bounds that refuse finite but absurd tensors),
`averaging` (exact gradient sums among replicas), `placement` (stage choice at join and
rebalancing, from the planner), `data`, `optim`, `reference` (single-process training, the
parity baseline), `inprocess` (a whole swarm in one process over an in-memory network), and
`versions` with `policy_serving` (a replica's parameters by policy version, for rollout peers).
"""
