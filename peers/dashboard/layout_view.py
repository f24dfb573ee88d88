"""What the dashboard and `status` say of the run's layout beyond its version: the layout the
planner would give the serving peers now, its predicted gain, and for how many polls in a row
that gain has held (`swarmtrain.plan.layout`'s proposal and hysteresis, on each poll's view)."""

from __future__ import annotations

import logging

from swarmtrain.errors import ConfigError
from swarmtrain.plan import LayoutGate
from swarmtrain.wire.records import PeerRecord, RunManifest

logger = logging.getLogger(__name__)


class LayoutWatch:
    """Poll by poll: the re-planned layout (`layout.replan_proposal`) and its streak."""

    def __init__(self):
        self.gate = LayoutGate()
        self._version: tuple[str, int] | None = None

    def observe(self, manifest: RunManifest, records: list[PeerRecord], costs: list) -> dict | None:
        """One poll: the proposal as a dict, with `streak` (polls in a row it has cleared the
        gate's `min_gain`) and `sustained` (the gate would move to it now); None when the
        planner would keep the live layout, or cannot say."""
        from swarmtrain.train.layout import replan_proposal

        version = (manifest.instance or manifest.run_id, manifest.layout_version)
        if version != self._version:  # a new layout: its proposals start afresh, by the run's rule
            self.gate, self._version = LayoutGate(manifest.replan), version
        try:
            proposal = replan_proposal(manifest, records, costs)
        except ConfigError as e:  # a peer on a stage the planner cannot evaluate
            logger.debug("no layout proposal for run %s: %s", manifest.run_id, e)
            proposal = None
        sustained = self.gate.observe(proposal) is not None
        if proposal is None:
            return None
        return proposal.to_dict() | {
            "streak": self.gate.streak,
            "patience": self.gate.config.patience,
            "min_gain": self.gate.config.min_gain,
            "sustained": sustained,
        }
