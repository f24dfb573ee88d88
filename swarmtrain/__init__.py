"""swarmtrain: elastic, decentralized pipeline training over unreliable, unequal GPUs."""

__version__ = "0.1.0"
