"""Train your own model through a swarm: a residual MLP classifier on a synthetic task.

    python examples/custom_model.py [--steps 40] [--stages 2]

The builder below is what every peer imports (by the path 'custom_model:build'); each
stage peer materialises only its own blocks. The data never leaves this process: the
trainer runs here, over a plain Python iterator.
"""

import argparse

import torch
from torch import nn

import swarmtrain as st

FEATURES, CLASSES = 16, 8


class ResidualBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):  # (B, dim) -> (B, dim)
        return x + torch.relu(self.fc(self.norm(x)))


def build(dim: int = 64, depth: int = 4) -> st.SwarmModel:
    return st.SwarmModel(
        embed=nn.Linear(FEATURES, dim),
        blocks=[ResidualBlock(dim) for _ in range(depth)],
        head=nn.Linear(dim, CLASSES),
        loss=nn.functional.cross_entropy,
        input_shape=(FEATURES,),
        input_dtype=torch.float32,
        target_shape=(),
        target_dtype=torch.int64,
    )


def batches(batch_size: int = 32, seed: int = 0):
    """Points around CLASSES random centres; the label is the centre's index."""
    g = torch.Generator().manual_seed(seed)
    centres = 1.5 * torch.randn(CLASSES, FEATURES, generator=g)
    while True:
        y = torch.randint(0, CLASSES, (batch_size,), generator=g)
        yield centres[y] + torch.randn(batch_size, FEATURES, generator=g), y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    args = parser.parse_args()
    config = st.LocalSwarmConfig(
        model="custom_model:build",
        model_config={"dim": 64, "depth": 4},
        num_stages=args.stages,
        batch=st.BatchConfig(microbatch_size=32, microbatches_per_step=2),
    )
    with st.LocalSwarm(config) as swarm, swarm.trainer() as trainer:
        for result in trainer.train(batches(), steps=args.steps):
            print(f"step {result.step:3d}  loss {result.loss:.3f}", flush=True)


if __name__ == "__main__":
    main()
