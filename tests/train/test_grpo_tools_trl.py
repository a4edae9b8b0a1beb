"""An environment class written for TRL runs unchanged under TRL 1.16's `GRPOTrainer` (the
oracle, a tiny Qwen2 model) and under pipe's multi-turn rollouts, and both do the same with it:
on the same tokenizer and chat template (TRL's own Qwen2.5 template, read from the installed
package) and the same model outputs (each engine's generation replaced by one script), TRL's
prompt tokens (tool schemas rendered, the `reset` text appended to the user turn), the tokens of
the second turn's request, the final completions and their tool masks, and each instance's state
afterwards (`get_reward`) equal pipe's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.serve.engine.sampling import SamplingParams
from pipeline.train.objectives.grpo.agent import Agent, choose_parser
from pipeline.train.objectives.grpo.rollout import Rollouts
from pipeline.train.objectives.grpo.tools import ToolBox, offered_schemas

pytest.importorskip("trl")
pytest.importorskip("datasets")
pytestmark = pytest.mark.filterwarnings("ignore")


class Counter:
    """A TRL environment: `reset` returns text for the user turn, `add` is its tool, the number
    of calls its reward."""

    def reset(self, **row) -> str:
        self.calls, self.row = 0, row
        return " Use the tool."

    def add(self, a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: The first.
            b: The second.
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.calls)


ROW = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
REPLIES = [CALL, "It is 5.<|im_end|>", "#### 5<|im_end|>"]  # in request order


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The tool example's tokenizer with Qwen's two turn tokens added, `<|im_end|>` its EOS,
    and TRL's Qwen2.5 chat template."""
    from tokenizers import Tokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    from pipeline.examples.tool_sums import make_task

    paths = make_task(tmp_path_factory.mktemp("sums"), sft=20, train=4, heldout=2)
    out = tmp_path_factory.mktemp("qwen_style")
    tok = Tokenizer.from_file(str(paths["tokenizer"] / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(out / "tokenizer.json"))
    config = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|end_of_text|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": qwen2_5_chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def trl_run(tokenizer_dir: Path) -> dict:
    """One TRL step on ROW (2 completions) with the model's generation scripted."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
    )
    args = GRPOConfig(
        output_dir=str(tokenizer_dir / "trl"),
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=128,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
    )
    trainer = GRPOTrainer(
        model=Qwen2ForCausalLM(config),
        args=args,
        train_dataset=Dataset.from_list([ROW] * 4),
        processing_class=tok,
        environment_factory=Counter,
    )
    seen = {"requests": [], "loop": None}
    replies = list(REPLIES)

    def generate(prompt_ids, images, fields, num_generations, has_tool_images=False):
        seen["requests"] += [list(p) for p in prompt_ids]
        texts = [replies.pop(0) for _ in prompt_ids]
        return [tok.encode(t, add_special_tokens=False) for t in texts], None

    loop = trainer._tool_call_loop

    def recorded(*args, **kwargs):
        seen["loop"] = loop(*args, **kwargs)
        return seen["loop"]

    trainer._generate_single_turn = generate
    trainer._tool_call_loop = recorded
    trainer.train()
    tool_mask, _, completion_ids = seen["loop"][:3]
    seen |= {"completions": completion_ids, "tool_masks": tool_mask}
    seen["calls"] = [e.calls for e in trainer.environments]
    seen["reset_rows"] = [sorted(e.row) for e in trainer.environments]
    return seen


def pipe_run(tokenizer_dir: Path) -> dict:
    """The same rollouts through pipe's `Agent` on a script of the same replies."""
    from pipeline.tokenizer.chat_template import eos_token_ids, load_chat_template
    from pipeline.tokenizer.tokenizer import load_tokenizer

    template, tok = load_chat_template(tokenizer_dir), load_tokenizer(tokenizer_dir)
    environments = [Counter(), Counter()]
    seen_text = [e.reset(**ROW) for e in environments]
    messages = [{**ROW["prompt"][0], "content": ROW["prompt"][0]["content"] + seen_text[0]}]
    schemas = offered_schemas([], Counter)
    text = template.render(messages, add_generation_prompt=True, tools=schemas).text
    prompt = tok.encode_batch([text])[0]
    replies, requests = list(REPLIES), []

    def generate(prompts, params) -> Rollouts:
        rows = [(p, each) for p, group in zip(prompts, params) for each in group]
        requests.extend(list(p) for p, _ in rows)
        ids = [tok.encode_batch([replies.pop(0)])[0] for _ in rows]
        return Rollouts([p for p, _ in rows], ids, [False] * len(ids))

    agent = Agent(
        parser=choose_parser("auto", template.source(tools=True)),
        template=template,
        tokenizer=tok,
        stop_ids=frozenset(eos_token_ids(template, tok)),
        max_completion_length=128,
        max_iterations=None,
        timeout=5.0,
    )
    params = [SamplingParams(128, seed=1), SamplingParams(128, seed=2)]
    ran = agent.run(generate, [prompt, prompt], params, [ToolBox([], e) for e in environments])
    return {
        "requests": requests,
        "completions": ran.rollouts.completions,
        "tool_masks": ran.rollouts.tool_masks,
        "calls": [e.calls for e in environments],
        "reset_rows": [sorted(e.row) for e in environments],
    }


def test_an_environment_runs_the_same_under_trl_and_pipe(tokenizer_dir: Path) -> None:
    theirs, ours = trl_run(tokenizer_dir), pipe_run(tokenizer_dir)
    assert len(theirs["requests"]) == len(ours["requests"]) == 3, (theirs, ours)
    assert theirs["requests"][:2] == ours["requests"][:2]  # the prompts as rendered and reset
    assert theirs["requests"][2] == ours["requests"][2]  # the second turn's whole sequence
    assert theirs["completions"] == ours["completions"]
    assert theirs["tool_masks"] == ours["tool_masks"]
    assert 0 in ours["tool_masks"][0] and 0 not in ours["tool_masks"][1]  # the call's result
    assert theirs["calls"] == ours["calls"] == [1, 0]
    assert theirs["reset_rows"] == ours["reset_rows"] == [["answer", "prompt"]] * 2
