"""The DHT keys swarmtrain stores under, and the record each holds (checked by
`swarmtrain.trust.records` on every node that stores or returns one).

| key                | subkey (= signer) | value                              |
|--------------------|-------------------|------------------------------------|
| `{run}.manifest`   | the run's owner   | RunManifest.to_dict()              |
| `{run}.peers`      | the peer          | PeerRecord.to_dict()               |
| `{run}.trainers`   | the trainer       | TrainerPoint.to_dict()             |
| `{run}.layout`     | the trainer       | LayoutRecord.to_dict()             |
| `swarmtrain.runs`  | the run's owner   | RunSummary: run_id, model, stages  |

Every record sits under the subkey of the peer whose key signed it, so nobody can write
another peer's record, and a run's manifest is told apart by its owner.
"""

from __future__ import annotations

from typing import Any

from swarmtrain.errors import ConfigError
from swarmtrain.wire.layout_record import LayoutRecord
from swarmtrain.wire.metrics import TrainerPoint
from swarmtrain.wire.records import PeerRecord, RunManifest, check_run_id

RUNS_KEY = "swarmtrain.runs"
MANIFEST_TTL_S = 24 * 3600.0
"""How long a manifest the owner signed stays valid. Serving peers store the owner's signed
copy again to keep it in the DHT after the coordinator leaves; they cannot extend it, and
the owner's next signature (a later expiry) replaces it."""


def manifest_key(run_id: str) -> str:
    return f"{run_id}.manifest"


def peers_key(run_id: str) -> str:
    return f"{run_id}.peers"


def trainers_key(run_id: str) -> str:
    """Subkey: trainer peer id; value: its latest TrainerPoint (what the dashboard charts)."""
    return f"{run_id}.trainers"


def layout_key(run_id: str) -> str:
    """Subkey: trainer peer id; value: the newest layout it moved the run to (LayoutRecord)."""
    return f"{run_id}.layout"


def run_summary(manifest: RunManifest) -> dict:
    """The entry a run's owner keeps under RUNS_KEY, so a peer can list the runs there are."""
    return {"run_id": manifest.run_id, "model": manifest.model, "num_stages": manifest.num_stages}


def check_record(key: str, signer: str, body: Any) -> None:
    """Raise ConfigError unless `body` is the record `key` holds, written by `signer` (the
    peer id of the key that signed it, which is also the record's subkey)."""
    if key == RUNS_KEY:
        if not isinstance(body, dict) or set(body) != {"run_id", "model", "num_stages"}:
            raise ConfigError("run summary: expected run_id, model and num_stages")
        check_run_id(body["run_id"])
        if not isinstance(body["model"], str) or not isinstance(body["num_stages"], int):
            raise ConfigError("run summary: model must be a name and num_stages an integer")
        return
    run_id, _, kind = key.rpartition(".")
    check_run_id(run_id)
    if kind == "manifest":
        manifest = RunManifest.from_dict(body)
        if manifest.run_id != run_id:
            raise ConfigError(f"manifest of run {manifest.run_id!r} stored under run {run_id!r}")
    elif kind == "peers":
        record = PeerRecord.from_dict(body)
        if record.peer_id != signer:
            raise ConfigError(f"peer record of {record.peer_id} signed by {signer}")
    elif kind == "trainers":
        point = TrainerPoint.from_dict(body)
        if point.trainer != signer:
            raise ConfigError(f"trainer point of {point.trainer} signed by {signer}")
    elif kind == "layout":
        layout = LayoutRecord.from_dict(body)
        if layout.planner != signer:
            raise ConfigError(f"layout planned by {layout.planner} signed by {signer}")
    else:
        raise ConfigError(f"{key!r} is not a swarmtrain key")
