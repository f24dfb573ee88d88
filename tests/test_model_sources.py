"""Where a peer takes model builders from: its registry, installed entry points, and only the
import paths it allows. A run's manifest comes from the DHT, so a path it names must never be
imported unless this peer chose to allow it.

Each builder module here is written to a temporary folder and records its own import in a
marker file, so a test sees whether the module ran, not only what resolve_builder returned.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from swarmtrain.errors import ConfigError, UnknownModelError
from swarmtrain.model import ModelSources, SwarmModel, build_model, build_stage, resolve_builder
from swarmtrain.peers.coordinator import CoordinatorConfig, make_manifest
from tests.conftest import wait_until

BUILDER_SOURCE = """
from pathlib import Path

import torch
from torch import nn

from swarmtrain.model import SwarmModel

Path({marker!r}).write_text("imported")


def build(width: int = 8) -> SwarmModel:
    return SwarmModel(
        embed=nn.Linear(4, width),
        blocks=[nn.Linear(width, width) for _ in range(2)],
        head=nn.Linear(width, 1),
        loss=nn.functional.mse_loss,
        input_shape=(4,),
        input_dtype=torch.float32,
        target_shape=(1,),
        target_dtype=torch.float32,
    )
"""


class BuilderModule:
    """A fresh, uniquely named module with a `build` builder on sys.path, that writes
    `marker` when it is imported."""

    def __init__(self, folder: Path, monkeypatch):
        self.name = f"lab_{uuid.uuid4().hex[:12]}"
        self.marker = folder / f"{self.name}.imported"
        (folder / f"{self.name}.py").write_text(BUILDER_SOURCE.format(marker=str(self.marker)))
        monkeypatch.syspath_prepend(str(folder))
        self.path = f"{self.name}:build"

    @property
    def imported(self) -> bool:
        return self.marker.exists()


@pytest.fixture
def lab(tmp_path, monkeypatch) -> BuilderModule:
    return BuilderModule(tmp_path, monkeypatch)


def test_an_unlisted_import_path_is_refused_before_it_is_imported(lab):
    with pytest.raises(UnknownModelError) as refused:
        resolve_builder(lab.path, named_by="the manifest of run 'demo'")
    message = str(refused.value)
    assert (
        f"the manifest of run 'demo' names the import path '{lab.path}', which this peer does not allow"
        in message
    )
    assert f"--allow-model '{lab.path}'" in message
    assert f"'{lab.name}:*'" in message
    assert "registry ('hf-causal-lm', 'tiny-gpt')" in message
    assert "entry points in group 'swarmtrain.models'" in message
    # A pattern for another module allows nothing here, nor does the default of build_stage.
    with pytest.raises(
        UnknownModelError, match=f"model '{lab.path}' is an import path this peer does not allow"
    ):
        build_model(lab.path, {}, sources=ModelSources(allow=("other_lab.*:*", f"{lab.name}:other")))
    with pytest.raises(UnknownModelError, match="this peer does not allow"):
        build_stage(lab.path, {}, 0, 1, seed=0)
    assert not lab.imported and lab.name not in sys.modules


def test_an_import_path_a_pattern_allows_is_built(lab):
    model = build_model(lab.path, {"width": 6}, sources=ModelSources(allow=("lab_*:build",)))
    assert isinstance(model, SwarmModel) and model.num_blocks == 2
    assert lab.imported
    # Its module has run: it stays resolvable in this process, as refusing it would protect nothing.
    assert resolve_builder(lab.path) is sys.modules[lab.name].build


def test_a_malformed_import_path_is_refused_even_when_a_pattern_matches_it():
    for ref in ("os:path.join", ".rel:build", "evil*:f", "a b:c"):
        with pytest.raises(UnknownModelError, match="an import path looks like 'package.module:function'"):
            resolve_builder(ref, ModelSources(allow=("*:*",)))


def test_allow_patterns_must_be_import_path_patterns():
    with pytest.raises(
        ConfigError, match=r"--allow-model 'mylab' is not a pattern of import paths.*'mylab.models:\*'"
    ):
        ModelSources(allow=("mylab",))
    with pytest.raises(ConfigError, match="a tuple of patterns"):
        ModelSources(allow="mylab:*")
    sources = ModelSources(allow=("mylab.models:*",))
    assert sources.allows("mylab.models:build") and not sources.allows("mylab.other:build")
    assert sources.allowing("tiny-gpt") is sources  # a name needs no allowance
    assert sources.allowing("x.y:f").allows("x.y:f") and not sources.allowing("x.y:f").allows("x.y:g")


def test_builtins_need_no_allowance():
    model = build_model("tiny-gpt", {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 8})
    assert model.num_blocks == 2
    with pytest.raises(
        UnknownModelError,
        match=r"unknown model 'gpt-5': builders come from swarmtrain's registry \('hf-causal-lm', 'tiny-gpt'\)",
    ):
        resolve_builder("gpt-5")


def install_entry_point(folder: Path, monkeypatch, *, name: str, value: str) -> None:
    """An installed distribution on sys.path whose metadata offers `name = value` in group
    'swarmtrain.models', as `pip install` of a package declaring it would leave it."""
    dist = folder / f"{name.replace('-', '_')}_models-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-models\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[swarmtrain.models]\n{name} = {value}\n")
    monkeypatch.syspath_prepend(str(folder))


def test_an_installed_entry_point_resolves_by_name_and_loads_lazily(tmp_path, monkeypatch, lab):
    name = f"ep-{lab.name}"
    install_entry_point(tmp_path, monkeypatch, name=name, value=lab.path)
    from swarmtrain.model import installed_models

    assert name in installed_models()
    assert not lab.imported  # listing reads metadata only
    model = build_model(name, {"width": 4})
    assert model.num_blocks == 2 and lab.imported
    # Known names stay listed where a peer is told what it may use.
    with pytest.raises(UnknownModelError, match=rf"entry points in group 'swarmtrain.models' \(.*'{name}'"):
        resolve_builder("no-such-model")


def test_a_broken_entry_point_says_which_package_offers_it(tmp_path, monkeypatch):
    name = f"ep-broken-{uuid.uuid4().hex[:8]}"
    install_entry_point(tmp_path, monkeypatch, name=name, value="no_such_module_xyz:build")
    with pytest.raises(
        UnknownModelError, match=rf"'no_such_module_xyz:build' of {name}-models failed to load"
    ):
        resolve_builder(name)


def test_the_coordinator_builds_its_own_import_path(lab):
    manifest = make_manifest(CoordinatorConfig(model=lab.path, model_config={"width": 4}, num_stages=2))
    assert manifest.model == lab.path and manifest.num_blocks == 2 and lab.imported


def test_a_manifest_loss_name_imports_nothing(lab):
    # Losses resolve only from the registry: one a builder's module registers is known only
    # once this peer allowed and built that model, and naming a loss loads no code.
    from swarmtrain.model import get_loss

    with pytest.raises(ConfigError, match="unknown loss"):
        get_loss(lab.path)
    assert not lab.imported


JOIN_TIMEOUT_S = 60.0


@pytest.mark.swarm
def test_a_stage_peer_refuses_a_run_whose_model_it_does_not_allow(local_swarm, tmp_path):
    """The coordinator runs its own import path; the launcher's stage peer, allowed it by the
    swarm's owner, serves; a peer joining without --allow-model exits with the refusal."""
    folder = tmp_path / "code"
    folder.mkdir()
    module = "lab_swarm_model"
    marker = folder / "imported"
    (folder / f"{module}.py").write_text(BUILDER_SOURCE.format(marker=str(marker)))
    swarm = local_swarm(
        model=f"{module}:build", model_config={"width": 4}, num_stages=1, env={"PYTHONPATH": str(folder)}
    )
    marker.unlink()  # written by the coordinator and the allowed peer
    proc = swarm.spawn(
        "outsider", ["join", "--initial-peers", swarm.address, "--gpu", "cpu", "--threads", "1"]
    )
    wait_until(lambda: proc.poll() is not None, timeout_s=JOIN_TIMEOUT_S, what="the refusing peer to exit")
    log = (swarm.log_dir / "outsider.log").read_text()
    assert proc.returncode == 2, log
    assert "Traceback" not in log, log
    assert (
        f"the manifest of run 'demo' names the import path '{module}:build', which this peer does not allow"
        in log
    )
    assert f"--allow-model '{module}:build'" in log
    assert not marker.exists()
