"""GRPO's tools: schemas equal transformers' `get_json_schema` (the oracle), a call's result or
failure as TRL writes it into the tool message, and the multi-turn rollout loop on a scripted
engine: the calls read from a turn, run, their messages' tokens appended through the chat
template and masked out of the loss, the next turn generated from the whole sequence, the
iteration limit, the completion budget, and an environment's reset text in the prompt."""

from __future__ import annotations

import json
import time
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from pipeline.serve.engine.sampling import SamplingParams
from pipeline.train.objectives.grpo.agent import Agent, choose_parser, tool_suffix
from pipeline.train.objectives.grpo.rollout import Rollouts, rollout_rows
from pipeline.train.objectives.grpo.tools import ToolBox, ToolError, run_call, tool_schema


class Color(Enum):
    RED = "red"
    BLUE = "blue"


def add(a: int, b: int = 2) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second one,
            on two lines.

    Returns:
        Their sum.
    """
    return a + b


def paint(color: Color, shade: Literal["light", "dark"] | None, sizes: list[float]) -> str:
    """Paint a wall.

    Args:
        color: The color.
        shade: How dark (choices: ["light", "dark"])
        sizes: Each wall's size.
    """
    return f"{color} {shade} {sizes}"


def lookup(table: dict[str, int], pair: tuple[int, str], anything: Any, flag: bool = False):
    """Look things up.

    Args:
        table: A table.
        pair: A pair.
        anything: Whatever.
        flag: A switch.
    """


class Shop:
    def buy(self, item: str, count: int | float) -> str:
        """Buy something.

        Args:
            item: What to buy.
            count: How many.
        """
        return f"bought {count} {item}"


@pytest.mark.parametrize("func", [add, paint, lookup, Shop().buy, Shop.buy])
def test_schemas_equal_transformers(func):
    from transformers.utils import get_json_schema

    assert tool_schema(func) == get_json_schema(func)


def test_schema_errors_are_one_line():
    def bare(x: int):
        return x

    def untyped(x):
        """Nothing.

        Args:
            x: A thing.
        """

    def undocumented(x: int):
        """No args section."""

    for func, said in [(bare, "no docstring"), (untyped, "no type hint"), (undocumented, "'x'")]:
        with pytest.raises(ToolError, match=said):
            tool_schema(func)


def test_a_call_returns_text_and_a_failure_is_trls_error_text():
    assert run_call(add, {"a": 3, "b": 4}, 5.0) == ("7", False)

    def broken(x: int) -> int:
        raise ZeroDivisionError("division by zero")

    assert run_call(broken, {"x": 1}, 5.0) == (str({"error": "division by zero"}), True)
    start = time.perf_counter()
    text, failed = run_call(lambda: time.sleep(5), {}, 0.2)
    assert failed and "0.2 s limit" in text and time.perf_counter() - start < 2
    box = ToolBox([add], Shop())
    assert list(box.functions) == ["add", "buy"]
    assert box.call("buy", '{"item": "pens", "count": 2}', 1.0) == ("bought 2 pens", False)
    assert box.call("nope", "{}", 1.0) == (str({"error": "Tool nope not found."}), True)
    assert box.call("add", "{oops", 1.0)[1] and box.call("add", "[1]", 1.0)[1]
    assert box.call("add", {"a": 1, "c": 2}, 1.0)[1]  # a TypeError is the model's to read


# ---- the loop on a scripted engine ------------------------------------------------------------


@pytest.fixture(scope="module")
def sums(tmp_path_factory) -> dict:
    from pipeline.examples.tool_sums import make_task
    from pipeline.tokenizer.chat_template import eos_token_ids, load_chat_template
    from pipeline.tokenizer.tokenizer import load_tokenizer

    paths = make_task(tmp_path_factory.mktemp("sums"), sft=20, train=20, heldout=4)
    template = load_chat_template(paths["tokenizer"])
    tokenizer = load_tokenizer(paths["tokenizer"])
    stop = frozenset({tokenizer.eod} | eos_token_ids(template, tokenizer))
    return {"template": template, "tokenizer": tokenizer, "stop": stop, "paths": paths}


class Script:
    """An engine that answers each request with the next scripted text (and its own seed)."""

    def __init__(self, tokenizer, replies: list[str], stop: int) -> None:
        self.tokenizer, self.replies, self.stop = tokenizer, list(replies), stop
        self.requests: list[tuple[list[int], Any]] = []

    def __call__(self, prompts, params) -> Rollouts:
        rows = [(p, each) for p, group in zip(prompts, params) for each in group]
        completions, truncated = [], []
        for prompt, each in rows:
            self.requests.append((list(prompt), each))
            ids = self.tokenizer.encode_batch([self.replies.pop(0)])[0] + [self.stop]
            completions.append(ids[: each.max_new_tokens])
            truncated.append(len(ids) > each.max_new_tokens)
        logprobs = [[-0.5] * len(c) for c in completions]
        return Rollouts([p for p, _ in rows], completions, truncated, logprobs=logprobs)


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "1663+5242"}}</tool_call>'


def agent(sums, length=64, iterations=None) -> Agent:
    return Agent(
        parser=choose_parser("auto", sums["template"].source(tools=True)),
        template=sums["template"],
        tokenizer=sums["tokenizer"],
        stop_ids=sums["stop"],
        max_completion_length=length,
        max_iterations=iterations,
        timeout=5.0,
    )


def test_a_rollout_calls_the_tool_and_its_tokens_carry_no_loss(sums):
    from pipeline.examples.tool_sums import calculator

    tok, eos = sums["tokenizer"], min(sums["stop"])
    prompt = tok.encode_batch(["<|begin_of_text|><|user|>\nWhat is 1663 + 5242?"])[0]
    script = Script(tok, [CALL, "#### 7000", "#### 6905"], eos)  # in request order
    params = [SamplingParams(64, seed=11), SamplingParams(64, seed=12)]
    boxes = [ToolBox([calculator]), ToolBox([calculator])]
    ran = agent(sums).run(script, [prompt, prompt], params, boxes)
    out = ran.rollouts
    # the first turn: one group of two sharing the prompt; the second: the first row alone
    assert [len(r[0]) for r in script.requests[:2]] == [len(prompt)] * 2
    first = tok.encode_batch([CALL])[0] + [eos]
    suffix = tool_suffix(
        sums["template"], tok, [{"role": "tool", "name": "c", "content": "6905"}], sums["stop"]
    )
    assert tok.decode(suffix) == "\n<|tool|>\n6905<|end_of_text|>\n<|assistant|>\n"
    assert script.requests[2][0] == prompt + first + suffix  # the whole sequence so far
    assert script.requests[2][1].seed not in (11, 12, None)
    assert script.requests[2][1].max_new_tokens == 64 - len(first) - len(suffix)
    final = tok.encode_batch(["#### 6905"])[0] + [eos]
    assert out.completions[0] == first + suffix + final
    assert out.tool_masks[0] == [1] * len(first) + [0] * len(suffix) + [1] * len(final)
    assert out.tool_masks[1] == [1] * len(out.completions[1])
    assert len(out.logprobs[0]) == len(out.completions[0])
    assert ran.texts == ["#### 6905", "#### 7000"] and ran.calls == [1, 0]
    assert ran.messages[0][1] == {"role": "tool", "name": "calculator", "content": "6905"}
    assert ran.messages[0][0]["tool_calls"][0]["function"]["arguments"] == {
        "expression": "1663+5242"
    }
    # the rows the loss sees: the tool message's positions are masked out
    rows = rollout_rows(out, 160, torch.device("cpu"))
    mask = rows["loss_mask"][0]
    start = len(prompt) - 1
    assert mask[start : start + len(first)].eq(1).all()
    assert mask[start + len(first) : start + len(first) + len(suffix)].eq(0).all()
    assert mask[start + len(first) + len(suffix) : start + len(out.completions[0])].eq(1).all()
    assert mask.sum() == len(first) + len(final)


def test_limits_failures_and_the_budget(sums):
    from pipeline.examples.tool_sums import calculator

    tok, eos = sums["tokenizer"], min(sums["stop"])
    prompt = tok.encode_batch(["<|user|>\nWhat is 1 + 2?"])[0]
    bad = CALL.replace("1663+5242", "one plus two")
    script = Script(tok, [bad, CALL, "never"], eos)
    ran = agent(sums, length=200, iterations=1).run(
        script, [prompt], [SamplingParams(200)], [ToolBox([calculator])]
    )
    assert ran.calls == [1] and ran.failures == [1] and len(script.requests) == 2  # one round
    assert "not an expression" in ran.messages[0][1]["content"]
    # a completion budget the tool message would overflow: the message is dropped, no new turn
    script = Script(tok, [CALL, "never"], eos)
    tight = len(tok.encode_batch([CALL])[0]) + 3
    ran = agent(sums, length=tight).run(
        script, [prompt], [SamplingParams(tight)], [ToolBox([calculator])]
    )
    assert len(script.requests) == 1 and ran.rollouts.tool_masks[0] == [1] * (tight - 2)
    assert [m["role"] for m in ran.messages[0]] == ["assistant"]


# ---- a run ------------------------------------------------------------------------------------

ENVIRONMENT = '''
import json
from pathlib import Path


class Counter:
    """Counts the calls of its tool; TRL's environment contract."""

    def reset(self, **row):
        self.calls = 0
        with open(Path(__file__).with_suffix(".log"), "a") as log:
            log.write(json.dumps(row) + "\\n")
        return " Use the tool."

    def add(self, a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: The first.
            b: The second.
        """
        self.calls += 1
        return a + b

    def get_reward(self):
        return float(self.calls) + len(str(id(self))) % 2 * 0.5
'''


def test_a_run_with_a_tool_and_an_environment(tmp_path: Path, sums) -> None:
    from tests.builders import records
    from tests.train.test_grpo import _train

    (tmp_path / "counter_env.py").write_text(ENVIRONMENT)
    sets = [
        "model.num_layers=2",
        "model.hidden_size=32",
        "model.num_attention_heads=4",
        "model.num_kv_heads=2",
        "model.ffn_hidden_size=64",
        "model.vocab_size=384",
        "model.max_position_embeddings=128",
        "data.kind=grpo",
        f"data.train_blend={sums['paths']['train']}",
        f"data.valid_blend={sums['paths']['heldout']}",
        f"data.tokenizer={sums['paths']['tokenizer']}",
        "data.seq_length=64",
        "data.num_workers=0",
        "training.iters=2",
        "training.micro_batch_size=2",
        "training.global_batch_size=2",
        "training.eval_interval=2",
        "training.eval_iters=1",
        "training.log_interval=1",
        "training.dtype=fp32",
        "training.device=cpu",
        "scheduler.warmup_iters=1",
        "scheduler.decay_iters=5",
        "checkpoint.save_interval=2",
        f"logging.run_dir={tmp_path / 'run'}",
        "grpo.num_generations=2",
        "grpo.max_completion_length=12",
        'grpo.reward_funcs=["accuracy"]',
        'grpo.tools=["pipeline.examples.tool_sums:calculator"]',
        f"grpo.environment={tmp_path / 'counter_env.py'}:Counter",
    ]
    _train(sets)
    train = records(tmp_path / "run")
    for step in (1, 2):
        assert "rewards/Counter/mean" in train[step] and "rewards/accuracy/mean" in train[step]
        assert train[step]["tools/call_frequency"] >= 0 and "tools/used" in train[step]
    resets = [json.loads(line) for line in (tmp_path / "counter_env.log").read_text().splitlines()]
    # one reset per rollout (2 prompts x 2 completions a step, 2 steps, then one evaluation
    # batch of 2 held-out prompts, once each), each with its prompt's line
    assert len(resets) == 2 * 2 * 2 + 2
    assert set(resets[0]) == {"prompt", "answer"} and resets[0]["prompt"].startswith("What is")
