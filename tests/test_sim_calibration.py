"""The simulator against real peers: small swarms run for real on loopback (real processes,
hivemind DHT and p2p, `join --slowdown`) and in the simulator agree on tokens/s within 10%.

One layout of even peers calibrates the two constants the simulator cannot know (what a
message and a commit cost beyond their bytes and compute, `sim.calibrate.calibrate`); each
peer's compute seconds per microbatch are measured in every run, as a profiler would. The
layouts compared are others: a replica 3 times slower than its stage's other, under
readiness routing and under static round-robin routing."""

from __future__ import annotations

import pytest

from swarmtrain.sim.calibrate import calibrate, compare, run_real

TOLERANCE = 0.10
STEPS, WARMUP = 12, 3
SLOW = 8.0
"""Every peer computes this many times slower than it can (sleeping): the 2 cores the peers
share then make little of each task's time, and the runs repeat closely."""


@pytest.mark.swarm
def test_real_and_simulated_swarms_agree_on_tokens_per_s():
    even = run_real([(0, SLOW), (1, SLOW)], steps=STEPS, warmup=WARMUP)
    calibration = calibrate(even)
    rows = [compare(even, calibration)]
    for schedule in ("readiness", "static"):
        uneven = run_real(
            [(0, SLOW), (0, 3 * SLOW), (1, SLOW)], steps=STEPS, warmup=WARMUP, schedule=schedule
        )
        rows.append(compare(uneven, calibration))
    for row in rows:
        print(row)
    for row in rows:
        assert abs(row["error"]) <= TOLERANCE, row
    # and the ranking holds: readiness routing is faster than static around the slow replica,
    # for real and in the simulator
    readiness, static = rows[1], rows[2]
    assert readiness["real_tokens_per_s"] > static["real_tokens_per_s"]
    assert readiness["sim_tokens_per_s"] > static["sim_tokens_per_s"]
