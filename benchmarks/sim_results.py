"""The simulator's results table: throughput against swarm size, preemption, heterogeneity,
routing policy and live re-planning, side by side from the same seeds.

    python benchmarks/sim_results.py [--quick] [--plots DIR] > results.json

Every row is one `swarmtrain.sim.simulate` run (the real policies, simulated peers and links).
Sweeps, each under the three routing policies (readiness, static, stochastic):
- size: 10, 100 and 1000 peers of the default mix (10% A100, 30% 4090, 30% 3090, 30% T4),
  and 10,000 under readiness routing (which also gives the simulator's events/s at that size);
- preemption: 100 peers at 0, 0.5 and 2 preemptions per spot peer per hour;
- heterogeneity: 100 peers all 4090s, the default mix, and a wide one (A100s to CPUs);
- re-planning: 100 peers with 1 preemption per hour, live re-planning on and off.
Each row adds `vs_readiness`: its tokens/s over the readiness row of the same case.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarmtrain.sim import Scenario, simulate  # noqa: E402
from swarmtrain.sim.scenario import PeerGroup, default_mix  # noqa: E402

POLICIES = ("readiness", "static", "stochastic")
WIDE = (("a100", 0.05), ("4090", 0.2), ("3090", 0.25), ("t4", 0.3), ("cpu", 0.2))


def wide_mix(n: int) -> tuple[PeerGroup, ...]:
    counts = [int(n * share) for _, share in WIDE]
    counts[-1] += n - sum(counts)
    return tuple(PeerGroup(profile=name, count=c) for (name, _), c in zip(WIDE, counts, strict=True) if c)


def cases(quick: bool) -> list[tuple[str, str, Scenario, tuple[str, ...]]]:
    d = 300.0 if quick else 1200.0
    out = []
    for n in (10, 100) if quick else (10, 100, 1000):
        out.append(("size", f"{n} peers", Scenario(peers=default_mix(n), duration_s=d), POLICIES))
    if not quick:
        out.append(
            ("size", "10000 peers", Scenario(peers=default_mix(10_000), duration_s=60.0), ("readiness",))
        )
    for rate in (0.0, 0.5, 2.0):
        s = Scenario(peers=default_mix(100), preemption_per_hour=rate, downtime_s=300, duration_s=2 * d)
        out.append(("preemption", f"{rate}/h", s, POLICIES))
    for name, peers in (
        ("all 4090", (PeerGroup(profile="4090", count=100),)),
        ("default mix", default_mix(100)),
        ("wide (A100..CPU)", wide_mix(100)),
    ):
        out.append(("heterogeneity", name, Scenario(peers=peers, duration_s=d), POLICIES))
    base = Scenario(peers=default_mix(100), preemption_per_hour=1.0, downtime_s=300, duration_s=2 * d)
    out.append(("re-planning", "on", base, POLICIES))
    out.append(("re-planning", "off", dataclasses.replace(base, replan=False), POLICIES))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs, no 1000 or 10,000 peers")
    parser.add_argument("--plots", help="write the figures of the size sweep's 100-peer runs here")
    args = parser.parse_args()
    rows, started = [], time.monotonic()
    for sweep, case, scenario, policies in cases(args.quick):
        results = {}
        for policy in policies:
            result = simulate(dataclasses.replace(scenario, policy=policy))
            results[policy] = result
            row = {"sweep": sweep, "case": case, **result.to_json()}
            rows.append(row)
            print(f"{sweep:13} {case:18} {policy:10} {row['tokens_per_s']:>12,.0f} tok/s "
                  f"{row['events_per_s']:>8,} ev/s {row['wall_s']:>7.1f} s", file=sys.stderr)  # fmt: skip
        base = results["readiness"].tokens_per_s
        for row in rows[-len(policies) :]:
            row["vs_readiness"] = round(row["tokens_per_s"] / base, 3) if base else None
        if args.plots and sweep == "size" and case == "100 peers":
            from swarmtrain.sim.report import write_plots

            write_plots(list(results.values()), args.plots)
    print(
        json.dumps(
            {"benchmark": "sim_results", "wall_s": round(time.monotonic() - started, 1), "rows": rows},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
