"""Run files (`--config FILE`, `--print-config`): a command's settings from a TOML file, flags
over it, the same checks as flags, and what `--print-config` writes reads back the same. The
README's example run files (pre-training and RL) load for every command they configure."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
from typer.testing import CliRunner

from swarmtrain.cli.main import app

REPO = Path(__file__).resolve().parent.parent
ADDR = "/ip4/10.0.0.5/tcp/31337/p2p/QmaGAVLdmc6Sy9iu3x5Pc7hgYKescyReqxbZ6HSAdyRhqi"


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def printed(*args: str) -> dict:
    result = run(*args, "--print-config")
    assert result.exit_code == 0, (result.output, result.exception)
    return tomllib.loads(result.output)


def test_print_config_reads_back_as_the_same_settings(tmp_path):
    first = printed("join", "--initial-peers", ADDR, "--stage", "1", "--gpu", "cpu", "--uplink-mbit", "20")
    assert first["join"]["stage"] == 1 and first["join"]["initial-peers"] == [ADDR]
    file = tmp_path / "join.toml"
    file.write_text(run("join", "--initial-peers", ADDR, "--stage", "1", "--gpu", "cpu", "--uplink-mbit", "20",
                        "--print-config").output)  # fmt: skip
    assert printed("join", "--config", str(file)) == first  # initial-peers, required, from the file


def test_flags_override_the_file_and_shared_keys_reach_every_command_that_has_them(tmp_path):
    file = tmp_path / "run.toml"
    file.write_text(
        f'run-id = "r1"\nsteps = 7\n[coordinator]\nstages = 2\n[train]\ninitial-peers = "{ADDR}"\n'
    )
    coordinator = printed("coordinator", "--config", str(file), "--steps", "9")["coordinator"]
    assert (coordinator["run-id"], coordinator["stages"], coordinator["steps"]) == ("r1", 2, 9)
    train = printed("train", "--config", str(file))["train"]
    assert (train["run-id"], train["steps"], train["initial-peers"]) == (
        "r1",
        7,
        [ADDR],
    )  # one string: a list of one


@pytest.mark.parametrize(
    "text, message",
    [
        ("[join]\nstagee = 1\n", "[join] has no setting 'stagee'; `swarmtrain join` takes: allow-model"),
        ("[join\n", "not valid TOML"),
        (f'[join]\ninitial-peers = ["{ADDR}"]\nport = 70000\n', "--port"),
        (f'[join]\ninitial-peers = ["{ADDR}"]\nmax-strikes = 0\n', "--max-strikes"),
        (f'[join]\ninitial-peers = ["{ADDR}"]\nlog-level = "loud"\n', "--log-level must be one of"),
        ("[join]\ninitial-peers = []\n", "initial-peers"),
    ],
)
def test_a_bad_run_file_is_refused_with_what_is_wrong(tmp_path, text, message):
    file = tmp_path / "bad.toml"
    file.write_text(text)
    result = run("join", "--config", str(file), "--print-config")
    assert result.exit_code != 0
    assert message in result.output + str(result.exception)


def test_a_missing_run_file_is_named():
    result = run("train", "--config", "/no/such/run.toml")
    assert "--config /no/such/run.toml: cannot read it" in str(result.exception)


@pytest.mark.parametrize("name", ["pretrain", "rl"])
def test_the_example_run_files_load_for_every_command_and_the_readme_shows_them(name, tmp_path, monkeypatch):
    path = REPO / "examples" / "runs" / f"{name}.toml"
    text = path.read_text()
    assert text in (REPO / "README.md").read_text()  # shown whole, as it is
    tables = [k for k, v in tomllib.loads(text).items() if isinstance(v, dict)]
    assert set(tables) == {"coordinator", "join", "train"}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "warm").mkdir()
    for command in tables:
        extra = () if command == "coordinator" else ("--initial-peers", ADDR)
        settings = printed(command, "--config", str(path), *extra)[command]
        assert settings["run-id"] == name
        for key, value in tomllib.loads(text)[command].items():
            assert settings[key] == value, (command, key)
    assert re.search(rf"--config examples/runs/{name}\.toml", text)


@pytest.mark.parametrize(
    "args, flag",
    [
        (("demo", "--stages", "0"), "--stages"),
        (("demo", "--port", "-3"), "--port"),
        (("join", "--initial-peers", ADDR, "--port", "70000"), "--port"),
        (("train", "--initial-peers", ADDR, "--steps", "-5"), "--steps"),
    ],
)
def test_numeric_flags_out_of_range_are_refused_before_anything_starts(args, flag):
    result = run(*args, "--print-config")  # refused while parsing: nothing printed, nothing started
    assert result.exit_code == 2 and f"Invalid value for '{flag}'" in result.output + str(result.exception)
