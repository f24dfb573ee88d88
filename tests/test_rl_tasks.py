"""RL tasks: deterministic prompts, exact binary rewards from text, a held-out split disjoint
from training, supervised warm-up batches, and where task builders may come from."""

from __future__ import annotations

import random
import uuid

import pytest
import torch

from swarmtrain.errors import ConfigError
from swarmtrain.model import get_loss
from swarmtrain.rl.registry import TaskSources, build_task, register_task, registered_tasks
from swarmtrain.rl.tasks import PAD_ID, ByteTokenizer, Task, warmup_batch


@pytest.mark.parametrize(
    ("name", "options", "prompt", "answer"),
    [
        ("add", {}, "12+34=", "46"),
        ("add", {}, "99+99=", "198"),
        ("add", {"digits": 3}, "500+700=", "1200"),
        ("sort", {}, "sort:31415=", "11345"),
        ("reverse", {}, "rev:abcde=", "edcba"),
    ],
)
def test_builtin_tasks_solve_and_reward_exactly(name, options, prompt, answer):
    task = build_task(name, options)
    assert task.solve(prompt) == answer
    assert task.target(prompt) == answer + "\n"
    assert task.reward(prompt, answer + "\n") == 1.0
    assert task.reward(prompt, answer + "\nanything after the marker") == 1.0
    assert task.reward(prompt, answer) == 0.0  # no end marker: ran out of tokens
    assert task.reward(prompt, answer + "0\n") == 0.0
    assert task.reward(prompt, " " + answer + "\n") == 0.0
    assert task.reward(prompt, "\n") == 0.0


@pytest.mark.parametrize("name", ["add", "sort", "reverse"])
def test_prompts_are_deterministic_and_answers_fit_the_budget(name):
    task = build_task(name)
    a = [task.train_prompt(random.Random(7)) for _ in range(3)]
    rng1, rng2 = random.Random(3), random.Random(3)
    assert [task.train_prompt(rng1) for _ in range(50)] == [task.train_prompt(rng2) for _ in range(50)]
    assert len(set(a)) == 1
    rng = random.Random(0)
    for _ in range(200):
        prompt = task.make_prompt(rng)
        assert len(task.tokenizer.encode(task.solve(prompt))) <= task.max_answer_tokens


def test_held_out_split_is_disjoint_from_training_and_stable():
    task = build_task("add")
    held = task.held_out_prompts(300, seed=0)
    assert len(set(held)) == 300 and all(task.is_held_out(p) for p in held)
    assert held == task.held_out_prompts(300, seed=0)
    rng = random.Random(1)
    train = {task.train_prompt(rng) for _ in range(3000)}
    assert not train & set(held)
    # about 10% of the 10,000 prompts are held out: the split is by hash, not by seed
    share = sum(task.is_held_out(f"{a}+{b}=") for a in range(100) for b in range(100)) / 10_000
    assert 0.08 < share < 0.12


def test_too_few_held_out_prompts_is_one_clear_error():
    task = build_task("add", {"digits": 1})  # 100 prompts, ~10 held out
    with pytest.raises(ConfigError, match="found only .* held-out prompts, fewer than the 50"):
        task.held_out_prompts(50)


def test_warmup_batch_weights_the_answer_tokens_only():
    task = build_task("add")
    x, inputs = warmup_batch(task, random.Random(0), batch_size=4, seq_len=16)
    assert x.shape == (4, 16) and x.dtype == torch.int64
    assert set(inputs) == {"targets", "weights"}
    tok = ByteTokenizer()
    for b in range(4):
        prompt = tok.decode(x[b].tolist()).split("=")[0] + "="
        seq = tok.encode(prompt + task.target(prompt))
        n = len(seq) - 1
        assert x[b, :n].tolist() == seq[:-1] and inputs["targets"][b, :n].tolist() == seq[1:]
        assert (x[b, n:] == PAD_ID).all()
        weighted = [
            t for t, w in zip(inputs["targets"][b].tolist(), inputs["weights"][b].tolist(), strict=True) if w
        ]
        assert tok.decode(weighted) == task.target(prompt)
    loss = get_loss("weighted_cross_entropy")(torch.zeros(4, 16, 256), inputs)
    share = inputs["weights"].mean()  # uniform logits: ln 256 per weighted position, over all positions
    assert torch.isclose(loss, share * torch.log(torch.tensor(256.0)))


def test_warmup_batch_that_does_not_fit_names_the_lengths():
    with pytest.raises(ConfigError, match="more than seq_len=8"):
        warmup_batch(build_task("add"), random.Random(0), batch_size=4, seq_len=8)


def test_task_options_are_checked():
    with pytest.raises(ConfigError, match="digits must be an integer in 1..9"):
        build_task("add", {"digits": 0})
    with pytest.raises(ConfigError, match="does not take options \\['width'\\].*it takes: digits"):
        build_task("add", {"width": 3})


def test_unknown_task_says_where_tasks_come_from():
    with pytest.raises(ConfigError, match="unknown task 'mul'.*'add', 'reverse', 'sort'.*TaskSources") as e:
        build_task("mul")
    assert "\n" not in str(e.value)


TASK_MODULE = """
from pathlib import Path
from swarmtrain.rl.tasks import Task
Path({marker!r}).write_text("imported")

def echo(length: int = 2) -> Task:
    return Task(name="echo", make_prompt=lambda rng: str(rng.randrange(10**length)) + "=",
                solve=lambda p: p[:-1], max_answer_tokens=length)

def not_a_task() -> int:
    return 3
"""


def test_a_users_task_by_import_path_only_when_allowed(tmp_path, monkeypatch):
    name = f"lab_tasks_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "imported"
    (tmp_path / f"{name}.py").write_text(TASK_MODULE.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=f"does not allow.*TaskSources\\(allow=\\('{name}:echo',\\)\\)"):
        build_task(f"{name}:echo")
    assert not marker.exists()  # refused before importing anything
    with pytest.raises(ConfigError, match="does not allow"):
        build_task(f"{name}:echo", sources=TaskSources(allow=("other.module:*",)))
    task = build_task(f"{name}:echo", {"length": 3}, sources=TaskSources(allow=(f"{name}:*",)))
    assert marker.exists() and task.reward("123=", "123\n") == 1.0
    with pytest.raises(ConfigError, match="returned a int, not a Task"):
        build_task(f"{name}:not_a_task", sources=TaskSources(allow=(f"{name}:*",)))
    with pytest.raises(ConfigError, match="is not a pattern of import paths"):
        TaskSources(allow=("lab_tasks",))


def test_registering_a_task_by_name():
    name = f"copy-{uuid.uuid4().hex[:6]}"

    @register_task(name)
    def copy_task() -> Task:
        return Task(name=name, make_prompt=lambda rng: "ab=", solve=lambda p: p[:-1], max_answer_tokens=2)

    assert name in registered_tasks()
    assert build_task(name).solve("xy=") == "xy"
    with pytest.raises(ConfigError, match="already registered"):
        register_task(name)(lambda: None)
    with pytest.raises(ConfigError, match="end marker must be one byte"):
        Task(name="t", make_prompt=lambda rng: "", solve=lambda p: p, max_answer_tokens=1, end_marker="<end>")
