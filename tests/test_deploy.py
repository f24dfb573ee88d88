"""What a deployment runs, checked without a container engine: every path the Dockerfile
copies exists and reaches the build context, the image installs the dashboard, every command
of docker/compose.yaml and docker/README.md gets through the CLI's own parser (its flags and
their checks), and --announce-host works with any port, on the coordinator too."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest
import tomllib
import typer
import yaml

from swarmtrain.cli.main import app
from swarmtrain.errors import ConfigError
from swarmtrain.swarm import NodeConfig, SwarmNode
from tests.conftest import wait_until

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
PEER_ID = "QmaGAVLdmc6Sy9iu3x5Pc7hgYKescyReqxbZ6HSAdyRhqi"


def dockerignored(path: str) -> bool:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    return any(fnmatch(path, p) or fnmatch(path.split("/")[0], p) for p in patterns)


def parse(argv: list[str]):
    """`swarmtrain ARGV` through the CLI's parser and flag checks, without running the command."""
    group = typer.main.get_command(app)
    name, *args = argv
    command = group.commands.get(name)
    assert command is not None, f"no command {name!r}"
    return command.make_context(name, args)


def test_the_dockerfile_copies_what_exists_and_the_context_keeps_it():
    copies = re.findall(r"^COPY\s+(.+)$", (DOCKER / "Dockerfile").read_text(), re.M)
    sources = [src for line in copies for src in line.split()[:-1]]
    assert {"pyproject.toml", "swarmtrain", "peers", "kernels", "cli"} <= set(sources)
    for src in sources:
        assert (REPO / src).exists(), f"the Dockerfile copies {src}, which is not in the repository"
        assert not dockerignored(src), f".dockerignore leaves {src} out of the build context"
    for heavy in (".git", ".venv", "tests/__pycache__", "swarmtrain.egg-info"):
        assert dockerignored(heavy), f"{heavy} would go into the build context"


def test_the_image_installs_the_dashboard():
    dockerfile = (DOCKER / "Dockerfile").read_text()
    extras = re.search(r"^ARG EXTRAS=(\S+)$", dockerfile, re.M).group(1).split(",")
    assert '".[${EXTRAS}]"' in dockerfile
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "dashboard" in extras and set(extras) <= set(declared)


def compose_commands() -> dict[str, list[str]]:
    services = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    return {name: service["command"] for name, service in services.items()}


def test_every_compose_command_parses(tmp_path):
    # the containers' volumes become folders here; the coordinator's address file is written
    # as the coordinator would
    volumes = {v: tmp_path / v.strip("/") for v in ("/shared", "/keys", "/checkpoints")}
    for folder in volumes.values():
        folder.mkdir()
    (volumes["/shared"] / "coordinator.address").write_text(f"/ip4/172.28.0.10/tcp/31337/p2p/{PEER_ID}\n")
    commands = compose_commands()
    assert {argv[0] for argv in commands.values()} == {"coordinator", "join", "train"}
    for service, argv in commands.items():
        local = [
            re.sub(r"(?<![\w/])(/shared|/keys|/checkpoints)", lambda m: str(volumes[m[1]]), a) for a in argv
        ]
        ctx = parse(local)
        if argv[0] != "coordinator":
            assert ctx.params["initial_peers"] == [f"/ip4/172.28.0.10/tcp/31337/p2p/{PEER_ID}"], service
        assert ctx.params.get("announce_host") is None or ctx.params["port"], service


def test_every_docker_command_of_the_readme_parses():
    placeholders = {"HOST": "203.0.113.5", "PUBLIC_IP": "198.51.100.7", "ID": PEER_ID}
    lines = [line.strip() for line in (DOCKER / "README.md").read_text().splitlines()]
    runs = [line for line in lines if line.startswith("docker run")]
    assert len(runs) >= 4
    for line in runs:
        words = shlex.split(re.sub(r"\b(HOST|PUBLIC_IP|ID)\b", lambda m: placeholders[m[1]], line))
        argv = words[words.index("swarmtrain") + 1 :]
        parse(argv)
    assert any("compose -f docker/compose.yaml up" in line for line in lines)


def test_a_bad_flag_in_a_deployment_command_is_caught(tmp_path):
    # the checks above are worth something only if the parser refuses what the CLI refuses
    with pytest.raises(Exception, match="No such option: --no-such-flag"):
        parse(["join", "--no-such-flag"])
    with pytest.raises(ConfigError, match="cannot read"):
        parse(["join", f"--initial-peers=@{tmp_path / 'missing'}"])
    with pytest.raises(ConfigError, match="announce host 'coordinator' is not an IPv4 address"):
        NodeConfig(announce_host="coordinator")  # a container's name: announce its address instead


async def _routing_table(dht, dht_node) -> list[str]:
    return [peer.to_base58() for peer in dht_node.protocol.routing_table.peer_id_to_uid]


@pytest.mark.swarm
def test_an_announced_host_with_a_port_picked_for_us_is_dialable():
    # --announce-host without --port: the node picks its port before the daemon starts, so the
    # address it announces names the port it listens on, and another peer joins through it
    node = SwarmNode(NodeConfig(host="0.0.0.0", announce_host="127.0.0.1"))
    try:
        (address,) = node.addresses()
        assert re.fullmatch(r"/ip4/127\.0\.0\.1/tcp/[1-9]\d*/p2p/\w+", address), address
        other = SwarmNode(NodeConfig(initial_peers=(address,)))
        try:
            known = other.dht.run_coroutine(_routing_table)
            assert node.peer_id in known, known
        finally:
            other.shutdown()
    finally:
        node.shutdown()


@pytest.mark.swarm
def test_the_coordinator_announces_its_host(tmp_path):
    address_file = tmp_path / "address"
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmtrain.cli", "coordinator", "--run-id", "deploy", "--host", "0.0.0.0",
         "--announce-host", "127.0.0.1", "--address-file", str(address_file), "--identity", str(tmp_path / "c.key")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    try:
        wait_until(
            lambda: address_file.exists() or proc.poll() is not None, timeout_s=120, what="the address file"
        )
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        address = address_file.read_text().strip()
        assert re.fullmatch(r"/ip4/127\.0\.0\.1/tcp/[1-9]\d*/p2p/\w+", address), address
        status = subprocess.run(
            [sys.executable, "-m", "swarmtrain.cli", "status", "--json", "--initial-peers", f"@{address_file}"],
            capture_output=True, text=True, cwd=REPO, timeout=120,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr[-2000:]
        assert '"deploy"' in status.stdout
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_without_the_dashboard_extra_the_coordinator_says_which_to_install(monkeypatch):
    # (the CI's wheel check runs the demo from an install without it: it runs, dashboard off)
    from typer.testing import CliRunner

    import swarmtrain.peers.dashboard as dashboard

    real_find_spec = dashboard.importlib.util.find_spec
    monkeypatch.setattr(
        dashboard.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "uvicorn" else real_find_spec(name, *a),
    )
    assert not dashboard.dashboard_available()
    result = CliRunner().invoke(app, ["coordinator", "--dashboard-port", "0"])
    assert result.exit_code != 0
    assert (
        "--dashboard-port: the dashboard needs the [dashboard] extra: pip install 'swarmtrain[dashboard]'"
        in (result.output + str(result.exception))
    )
