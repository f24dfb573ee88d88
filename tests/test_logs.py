"""Logs people can use: --log-level, --log-file and --log-format json on the commands that run
for long, and their bad values refused while the flags are parsed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NOBODY = "/ip4/127.0.0.1/tcp/9/p2p/QmaGAVLdmc6Sy9iu3x5Pc7hgYKescyReqxbZ6HSAdyRhqi"


def swarmtrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarmtrain.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_json_lines_go_to_the_file_and_stderr_at_the_level_asked(tmp_path):
    log = tmp_path / "status.log"
    done = swarmtrain(
        "status",
        "--initial-peers",
        NOBODY,
        "--log-level",
        "debug",
        "--log-format",
        "json",
        "--log-file",
        str(log),
    )
    assert done.returncode == 2 and "could not reach any of --initial-peers" in done.stderr
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert entries and all(set(e) >= {"time", "level", "logger", "message"} for e in entries)
    assert "debug" in {e["level"] for e in entries}  # debug asked for, debug written
    assert json.dumps(entries[0]) in done.stderr  # the same lines on stderr

    quiet = swarmtrain("status", "--initial-peers", NOBODY, "--log-file", str(tmp_path / "quiet.log"))
    assert "DEBUG" not in quiet.stderr and not (tmp_path / "quiet.log").read_text().count("DEBUG")


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--log-level", "loud"), "--log-level must be one of debug, info, warning, error, got 'loud'"),
        (("--log-format", "xml"), "--log-format must be 'text' or 'json', got 'xml'"),
        (
            ("--log-file", "/no/such/folder/x.log"),
            "--log-file /no/such/folder/x.log: folder /no/such/folder does not exist",
        ),
    ],
)
@pytest.mark.parametrize("command", ["coordinator", "join", "train"])
def test_bad_log_flags_are_refused_before_anything_starts(command, flags, message):
    done = swarmtrain(command, *flags)
    assert done.returncode == 2 and message in done.stderr, done.stderr
