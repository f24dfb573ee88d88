"""`swarmtrain simulate`: a swarm of simulated peers, driven by the real policies."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated

import typer

from swarmtrain.cli.options import run_guarded


def simulate(
    scenario: Annotated[
        str | None,
        typer.Option(
            help="A scenario file (TOML; examples/sim/spot-swarm.toml). Flags override it.",
            show_default="the built-in scenario: 8 4090s and 8 T4s",
        ),
    ] = None,
    peers: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Peers of the default mix (10% A100, 30% 4090, 30% 3090, 30% T4).",
            show_default="the scenario's peers",
        ),
    ] = None,
    mix: Annotated[
        str | None,
        typer.Option(
            help="Peers as PROFILE:COUNT,... e.g. 4090:100,t4:300.", show_default="the scenario's peers"
        ),
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option(
            help="readiness, static or stochastic; several comma-separated run side by side.",
            show_default="readiness",
        ),
    ] = None,
    replan: Annotated[
        bool | None,
        typer.Option(
            "--replan/--no-replan", help="Live re-planning: peers move between stages.", show_default="on"
        ),
    ] = None,
    preemption_per_hour: Annotated[
        float | None, typer.Option(min=0.0, help="Preemptions per spot peer per hour.", show_default="0")
    ] = None,
    stall_per_hour: Annotated[
        float | None, typer.Option(min=0.0, help="Stalls per peer per hour.", show_default="0")
    ] = None,
    duration_s: Annotated[
        float | None, typer.Option(min=1.0, help="Simulated seconds.", show_default="600")
    ] = None,
    stages: Annotated[
        int | None, typer.Option(min=1, help="Pipeline stages.", show_default="the planner's choice")
    ] = None,
    neighbors: Annotated[
        int | None,
        typer.Option(min=0, help="Replicas each router chooses among (0: all).", show_default="16"),
    ] = None,
    codec: Annotated[
        str | None, typer.Option(help="Activation codec: none, fp16, int8, nf4.", show_default="int8")
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Random seed: the same seed gives the same result.", show_default="0")
    ] = None,
    plots: Annotated[
        str | None, typer.Option(help="Write PNG figures into this folder.", show_default="no figures")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON only.")] = False,
) -> None:
    """Simulate a swarm at any scale with the real scheduling, routing and planning policies."""
    from swarmtrain.errors import ConfigError
    from swarmtrain.sim import Scenario, load_scenario
    from swarmtrain.sim import simulate as run
    from swarmtrain.sim.scenario import POLICIES, default_mix
    from swarmtrain.sim.scenario import mix as parse_mix

    def main() -> None:
        base = load_scenario(scenario) if scenario else Scenario()
        changes = {
            "replan": replan,
            "preemption_per_hour": preemption_per_hour,
            "stall_per_hour": stall_per_hour,
            "duration_s": duration_s,
            "stages": stages,
            "neighbors": neighbors,
            "codec": codec,
            "seed": seed,
        }
        changes = {k: v for k, v in changes.items() if v is not None}
        if peers is not None and mix is not None:
            raise ConfigError("give --peers or --mix, not both")
        if peers is not None:
            changes["peers"] = default_mix(peers)
        if mix is not None:
            changes["peers"] = parse_mix(mix)
        policies = [p.strip() for p in (policy or base.policy).split(",") if p.strip()]
        for p in policies:
            if p not in POLICIES:
                raise ConfigError(f"--policy {p!r}: use {', '.join(POLICIES)} (several comma-separated)")
        results = []
        for p in policies:
            s = dataclasses.replace(base, policy=p, **changes)
            if not as_json:
                typer.echo(f"simulating {s.num_peers} peers, {p}, {s.duration_s:g} s ...", err=True)
            results.append(run(s))
        report = [r.to_json() for r in results]
        if plots:
            from swarmtrain.sim.report import write_plots

            files = write_plots(results, plots)
            if not as_json:
                typer.echo(f"wrote {len(files)} figures to {plots}", err=True)
        if as_json:
            typer.echo(json.dumps(report[0] if len(report) == 1 else report, indent=2))
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title="swarmtrain simulate")
        for col in ("policy", "re-plan", "peers", "stages", "tokens/s", "of plan", "steps", "preempted",
                    "replays", "events/s"):  # fmt: skip
            table.add_column(col, justify="right")
        for row in report:
            table.add_row(
                row["policy"], "on" if row["replan"] else "off", str(row["peers"]), str(row["stages"]),
                f"{row['tokens_per_s']:,.0f}", f"{row['of_plan']}", str(row["steps"]),
                str(row.get("preempted", 0)), str(row.get("hop_retries", 0) + row.get("replayed_for_commit", 0)),
                f"{row['events_per_s']:,}",
            )  # fmt: skip
        Console(width=120).print(table)

    run_guarded(main)
