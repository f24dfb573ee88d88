"""Moving a running swarm to a new layout (`coordinator --replan`), on a real swarm: the lead
trainer re-plans from the serving peers' measured speeds, by the rule in the run's manifest,
moves every stage peer between two steps (blocks change hands by name), and training goes on
from the same step with the losses of an uninterrupted single-process run."""

import signal

import pytest

from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.wire.records import BatchConfig, OptimizerConfig
from tests.conftest import TINY_GPT, assert_losses_match_reference, reference_losses

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

MODEL = TINY_GPT | {"n_layer": 6}
SEED = 4
OPTIMIZER = OptimizerConfig(name="adamw", lr=3e-3)
"""Milder than the other swarm tests' 1e-2: a run that goes on for 100 steps with two replicas summing
their gradients (in another order than one process) must not turn chaotic, or rounding grows
beyond the parity tolerance whatever the layout does."""
BATCH = BatchConfig(microbatch_size=4, microbatches_per_step=4, max_in_flight=4)
STILL = ("--rebalance-every", "0")
REPLAN = ("--replan", "--replan-gain", "0.5", "--replan-patience", "1", "--replan-every", "1")
SLOW_FROM = 3
"""Steps before stage 1's peer turns 4x slower: until then the even split is the planner's too."""


def batches():
    return TokenBatches(stdlib_text(2**20), seq_len=MODEL["seq_len"], microbatch_size=4, seed=SEED)


def replanning_swarm(local_swarm, slow):
    """Two stages, one peer each, split evenly; stage 1's peer is as slow as the number in the
    file `slow` says (once written); the coordinator re-plans every second."""
    return local_swarm(
        model_config=MODEL,
        num_stages=2,
        seed=SEED,
        optimizer=OPTIMIZER,
        batch=BATCH,
        stage_args={0: STILL, 1: (*STILL, "--slowdown-file", str(slow))},
        coordinator_args=REPLAN,
    )


def assert_parity(results) -> None:
    """Every step, in order, with the losses of single-process training."""
    assert [r.step for r in results] == list(range(len(results)))
    reference = reference_losses(
        seed=SEED, optimizer=OPTIMIZER, batches=batches(), steps=len(results), microbatches_per_step=4,
        model_config=MODEL,
    )  # fmt: skip
    assert_losses_match_reference(results, reference)


def test_a_layout_move_mid_run_keeps_loss_parity(local_swarm, tmp_path):
    """Two stages split evenly over two equal peers; after a few steps the coordinator dies
    (kill -9) and stage 1's peer turns 4x slower. The trainer re-plans from the measured speeds
    without it (stage 1 gets fewer blocks), publishes the layout signed by itself, moves the
    swarm between two steps, and every step's loss, before and after the move, equals
    single-process training's."""
    slow = tmp_path / "slowdown"
    swarm = replanning_swarm(local_swarm, slow)
    slow_id = swarm.wait_ready("stage1-2")
    results, after = [], 0
    with swarm.trainer() as trainer:
        for result in trainer.train(batches(), steps=150):
            results.append(result)
            if len(results) == SLOW_FROM:
                swarm.signal("coordinator", signal.SIGKILL)  # no layout changes by the owner's hand
                slow.write_text("4")
            after += bool(trainer.layout_moves)
            if after == 3:
                break
        moves, manifest = list(trainer.layout_moves), trainer.manifest
        records = [r for r in trainer.node.peers(manifest.run_id) if r.role == "stage"]
        planners = {(r.planner, r.version) for r in trainer.node.layout_records(manifest.run_id)}
    assert after == 3, f"no layout move in {len(results)} steps"
    assert swarm.procs["coordinator"].wait(timeout=30) == -9
    # the trainer published layout 2 and nobody else any; on a busy machine whose speeds swing
    # it may have re-planned once more (its one record then holds layout 3) without having
    # moved to it yet when the loop stopped: the move below is still to layout 2
    assert {p for p, _ in planners} == {trainer.node.peer_id} and min(v for _, v in planners) >= 2, planners
    ((step, version, paused),) = moves
    assert step >= SLOW_FROM, moves  # mid-run, once a stage slowed down
    assert version == 2 and manifest.layout_version == 2 and manifest.stage_bounds != (0, 3, 6)
    b = manifest.stage_bounds
    slow_stage = next(r.stage for r in records if r.peer_id == slow_id)
    assert b[slow_stage + 1] - b[slow_stage] < 3, (b, slow_stage)  # the slow peer holds fewer blocks
    assert manifest.layout_note.startswith("re-planned from"), manifest.layout_note
    assert sorted((r.stage, r.layout) for r in records) == [(0, 2), (1, 2)], records
    assert paused < 30, paused
    assert_parity(results)


def test_a_peer_killed_during_a_move_leaves_the_swarm_on_one_layout(local_swarm, tmp_path):
    """Stage 1 has two replicas; the fast one dies (kill -9) in the middle of the move, once it
    kept its old stage's state. Whether the others complete the move without it or undo it (the
    peers that moved take their old stage back from their snapshot), the swarm ends on one
    layout with every stage served, and training goes on with parity."""
    slow = tmp_path / "slowdown"
    swarm = replanning_swarm(local_swarm, slow)
    # at full speed: the re-plan keeps it (the slow replica may go), so its death usually
    # leaves a stage of the new layout without a peer and the move is undone
    doomed = swarm.spawn_stage(1, extra_args=(*STILL, "--inject-fault", "kill:relayout:1"))
    results, after = [], 0
    with swarm.trainer() as trainer:
        for result in trainer.train(batches(), steps=150):
            results.append(result)
            if len(results) == SLOW_FROM:
                slow.write_text("4")
            after += swarm.procs[doomed].poll() is not None
            if after == 5:
                break
        manifest = trainer.manifest
        records = [
            r for r in trainer.node.peers(manifest.run_id) if r.role == "stage" and r.state == "serving"
        ]
        records = [r for r in records if r.peer_id != swarm.wait_ready(doomed)]  # its record may outlive it
    assert after == 5, f"the doomed peer never moved in {len(results)} steps:\n{swarm.log_tail(doomed)}"
    assert swarm.procs[doomed].wait(timeout=30) == -9
    assert {r.layout for r in records} == {manifest.layout_version}, (manifest.layout_version, records)
    assert {r.stage for r in records} == {0, 1}, records
    assert_parity(results)


def test_a_move_that_leaves_a_stage_without_a_peer_is_undone(local_swarm):
    """A layout (published as the run's trainer would) gives both peers stage 0: stage 1 of it
    would have no peer. The trainer undoes the move (each peer takes its old stage back from
    its snapshot), publishes the layout the swarm is on as the next version, never tries the
    failed one again, and training goes on with parity."""
    from swarmtrain.wire.layout_record import LayoutRecord

    swarm = local_swarm(
        model_config=MODEL,
        num_stages=2,
        seed=SEED,
        optimizer=OPTIMIZER,
        batch=BATCH,
        stage_args={0: STILL, 1: STILL},
        coordinator_args=("--replan", "--replan-gain", "100", "--replan-every", "1"),  # no move of its own
    )
    ids = [swarm.wait_ready("stage0-1"), swarm.wait_ready("stage1-2")]
    results = []
    with swarm.trainer() as trainer:
        run_id = trainer.manifest.run_id
        for result in trainer.train(batches(), steps=150):
            results.append(result)
            if len(results) == 3:
                doomed = LayoutRecord(
                    planner=trainer.node.peer_id,
                    version=2,
                    stage_bounds=(0, 2, 6),
                    assignments=dict.fromkeys(ids, 0),
                )
                trainer.node.publish_layout(run_id, doomed, ttl_s=600).result()
            if trainer.manifest.layout_version == 3 and len(results) >= 6:
                break
        failed, manifest, moves = set(trainer.failed_layouts), trainer.manifest, list(trainer.layout_moves)
        records = [r for r in trainer.node.peers(run_id) if r.role == "stage"]
    assert failed == {2} and [v for _, v, _ in moves] == [3], (failed, moves)
    assert manifest.layout_version == 3 and manifest.stage_bounds == (0, 3, 6), manifest
    assert manifest.layout_note.startswith("the move to layout 2 did not complete"), manifest.layout_note
    assert sorted((r.peer_id, r.stage, r.layout) for r in records) == sorted(
        [(ids[0], 0, 3), (ids[1], 1, 3)]
    ), records
    assert_parity(results)
