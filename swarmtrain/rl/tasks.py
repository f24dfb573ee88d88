"""Tasks with verifiable rewards: prompts, the exact answer, and a binary reward from text.

A task draws prompts from a seeded `random.Random` (so the same seed gives the same prompts
on every peer) and can compute the one right answer for any of its prompts. A completion is
text the policy wrote after the prompt; its reward is

    1.0  if the completion, up to its first end marker, is exactly the right answer and the
         end marker is there;
    0.0  otherwise (a wrong answer, or no end marker within the token budget).

No partial or format credit: the reward is binary, and anyone holding the prompt and the
completion text can check it (`Task.reward`), so a trainer never needs to trust a reward
someone else computed.

Tokens are bytes: `ByteTokenizer` maps text to its UTF-8 bytes, ids 0..255, which is
tiny-gpt's vocabulary. The end marker is one byte, '\\n' by default; the id of that byte is
the token that stops generation.

Prompts split into train and held-out by a hash of the prompt text alone (`Task.is_held_out`),
so the split is the same on every peer and for every seed; training draws only train prompts,
`held_out_prompts` only held-out ones.

Built-in tasks (builders in the task registry, `swarmtrain.rl.registry`):
    add      '12+34=' -> '46'       (digits: 2)
    sort     'sort:31415=' -> '11345'  (length: 5)
    reverse  'rev:abcde=' -> 'edcba'   (length: 5)
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from swarmtrain.errors import ConfigError
from swarmtrain.rl.registry import register_task

END_MARKER = "\n"
"""The default end-of-answer marker."""
PAD_ID = 0
"""Token id written past the end of a sequence in a batch; its positions carry zero weight."""


class ByteTokenizer:
    """Text <-> byte token ids 0..255 (UTF-8), with one byte as the end-of-answer marker."""

    vocab_size = 256

    def __init__(self, end_marker: str = END_MARKER):
        if len(end_marker.encode()) != 1:
            raise ConfigError(f"the end marker must be one byte, got {end_marker!r}")
        self.end_marker = end_marker
        self.end_id = end_marker.encode()[0]
        """The token that ends an answer (and stops generation)."""

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`, as ids."""
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        """Text of byte ids; bytes that are not valid UTF-8 become U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")


@dataclass(frozen=True, kw_only=True)
class Task:
    """A task with a verifiable answer: what prompts look like and what answers them."""

    name: str
    """Its name, e.g. 'add'."""
    make_prompt: Callable[[random.Random], str]
    """Draws one prompt with the given generator (all of its randomness must come from it)."""
    solve: Callable[[str], str]
    """The one right answer to a prompt, without the end marker."""
    max_answer_tokens: int
    """The longest right answer, in tokens, without the end marker: a generation budget."""
    end_marker: str = END_MARKER
    """One byte that ends every answer."""
    held_out_percent: int = 10
    """Percent of the prompt space (by hash) kept out of training, for evaluation."""

    def __post_init__(self):
        if not isinstance(self.max_answer_tokens, int) or self.max_answer_tokens < 1:
            raise ConfigError(
                f"task {self.name!r}: max_answer_tokens must be >= 1, got {self.max_answer_tokens!r}"
            )
        if not isinstance(self.held_out_percent, int) or not 0 < self.held_out_percent < 100:
            raise ConfigError(
                f"task {self.name!r}: held_out_percent must be an integer in 1..99, got {self.held_out_percent!r}"
            )
        ByteTokenizer(self.end_marker)  # checks the marker is one byte

    @property
    def tokenizer(self) -> ByteTokenizer:
        """The byte tokenizer with this task's end marker."""
        return ByteTokenizer(self.end_marker)

    @property
    def max_new_tokens(self) -> int:
        """Tokens a completion may take: the longest answer and its end marker."""
        return self.max_answer_tokens + 1

    def target(self, prompt: str) -> str:
        """The completion that earns reward 1: the answer and the end marker."""
        answer = self.solve(prompt)
        assert self.end_marker not in answer, f"task {self.name!r}: answer {answer!r} holds the end marker"
        return answer + self.end_marker

    def reward(self, prompt: str, completion: str) -> float:
        """1.0 if `completion` is the right answer followed by the end marker (anything after the
        marker is ignored), else 0.0."""
        answer, marker, _ = completion.partition(self.end_marker)
        return 1.0 if marker and answer == self.solve(prompt) else 0.0

    def is_correct(self, reward: float) -> bool:
        """Whether a completion that earned `reward` is fully right (the reward is binary: 1.0)."""
        return reward >= 1.0

    def is_held_out(self, prompt: str) -> bool:
        """Whether `prompt` belongs to the held-out split: by sha256 of its text, the same everywhere."""
        bucket = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little") % 100
        return bucket < self.held_out_percent

    def train_prompt(self, rng: random.Random) -> str:
        """A prompt of the train split, drawn with `rng`."""
        while True:
            prompt = self.make_prompt(rng)
            if not self.is_held_out(prompt):
                return prompt

    def held_out_prompts(self, n: int, *, seed: int = 0) -> list[str]:
        """`n` distinct held-out prompts, the same for the same `seed`.

        Raises ConfigError if the held-out split seems to hold fewer than `n` prompts (none new
        in 1000 draws in a row).
        """
        rng, found, misses = random.Random(seed), {}, 0
        while len(found) < n:
            prompt = self.make_prompt(rng)
            if self.is_held_out(prompt) and prompt not in found:
                found[prompt], misses = None, 0
            else:
                misses += 1
                if misses > 1000:
                    raise ConfigError(
                        f"task {self.name!r}: found only {len(found)} held-out prompts, fewer than the {n} asked for"
                    )
        return list(found)


def warmup_batch(
    task: Task, rng: random.Random, *, batch_size: int, seq_len: int
) -> tuple[Tensor, dict[str, Tensor]]:
    """A supervised microbatch of `batch_size` train prompts with their right answers.

    Returns (x, {'targets', 'weights'}), the inputs of the registered 'weighted_cross_entropy':
    x (B, seq_len) int64 is prompt + answer (+ end marker, as a target), right-padded with
    PAD_ID from position 0 on; targets (B, seq_len) int64 the next tokens; weights (B, seq_len)
    float32 are 1 where the target is an answer token or the end marker, 0 on the prompt and
    the padding. Raises ConfigError if a sequence does not fit in `seq_len`.
    """
    tok = task.tokenizer
    x = torch.full((batch_size, seq_len), PAD_ID, dtype=torch.int64)  # (B, T)
    targets = torch.full((batch_size, seq_len), PAD_ID, dtype=torch.int64)  # (B, T)
    weights = torch.zeros(batch_size, seq_len)  # (B, T)
    for b in range(batch_size):
        prompt = task.train_prompt(rng)
        p_ids, a_ids = tok.encode(prompt), tok.encode(task.target(prompt))
        seq = p_ids + a_ids
        if len(seq) - 1 > seq_len:
            raise ConfigError(
                f"task {task.name!r}: prompt and answer take {len(seq) - 1} positions, more than seq_len={seq_len}"
            )
        L = len(seq) - 1
        x[b, :L] = torch.tensor(seq[:-1])
        targets[b, :L] = torch.tensor(seq[1:])
        weights[b, len(p_ids) - 1 : L] = 1.0  # targets that are answer tokens or the marker
    return x, {"targets": targets, "weights": weights}


# built-in tasks


@register_task("add")
def add_task(digits: int = 2) -> Task:
    """'a+b=' -> the decimal sum, a and b uniform in [0, 10**digits)."""
    if not isinstance(digits, int) or not 1 <= digits <= 9:
        raise ConfigError(f"task 'add': digits must be an integer in 1..9, got {digits!r}")

    def make_prompt(rng: random.Random) -> str:
        return f"{rng.randrange(10**digits)}+{rng.randrange(10**digits)}="

    def solve(prompt: str) -> str:
        a, b = prompt.removesuffix("=").split("+")
        return str(int(a) + int(b))

    return Task(name="add", make_prompt=make_prompt, solve=solve, max_answer_tokens=digits + 1)


@register_task("sort")
def sort_task(length: int = 5) -> Task:
    """'sort:31415=' -> '11345': `length` random decimal digits, sorted ascending."""
    if not isinstance(length, int) or not 1 <= length <= 32:
        raise ConfigError(f"task 'sort': length must be an integer in 1..32, got {length!r}")

    def make_prompt(rng: random.Random) -> str:
        return "sort:" + "".join(rng.choice("0123456789") for _ in range(length)) + "="

    def solve(prompt: str) -> str:
        return "".join(sorted(prompt.removeprefix("sort:").removesuffix("=")))

    return Task(name="sort", make_prompt=make_prompt, solve=solve, max_answer_tokens=length)


@register_task("reverse")
def reverse_task(length: int = 5) -> Task:
    """'rev:abcde=' -> 'edcba': `length` random lowercase letters, reversed."""
    if not isinstance(length, int) or not 1 <= length <= 32:
        raise ConfigError(f"task 'reverse': length must be an integer in 1..32, got {length!r}")

    def make_prompt(rng: random.Random) -> str:
        return "rev:" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(length)) + "="

    def solve(prompt: str) -> str:
        return prompt.removeprefix("rev:").removesuffix("=")[::-1]

    return Task(name="reverse", make_prompt=make_prompt, solve=solve, max_answer_tokens=length)
