"""`pipe train`'s objective flags come from the objectives' registry: `--objective NAME` for any
registered objective, each entry's `--KIND` flag and its options, one at most chosen, an option
refused for a run of another objective. Dry runs only: nothing is built."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.train.objectives import OBJECTIVES

DATA = {
    "gpt": [],
    "sft": ["--data", "out/chat_messages_document"],
    "dpo": ["--data", "out/pairs"],
    "grpo": [
        *("--data", "out/prompts.jsonl", "--set", "data.tokenizer=out/tok"),
        *("--set", "grpo.max_completion_length=64"),
    ],
}


def _dry_run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["train", "--dry-run", "--recipe", "tiny", *args])
    return result.exit_code, result.output


def _kind(output: str) -> str:
    data = output.split("[data]", 1)[1]
    return next(line for line in data.splitlines() if line.startswith("kind = ")).split('"')[1]


def test_every_registered_objective_has_its_data() -> None:
    assert set(DATA) == set(OBJECTIVES)  # a new objective: add its dry-run data here


@pytest.mark.parametrize("kind", sorted(OBJECTIVES))
def test_objective_name_chooses_the_kind(kind: str) -> None:
    code, output = _dry_run("--objective", kind, *DATA[kind])
    assert code == 0, output
    assert _kind(output) == kind


@pytest.mark.parametrize("kind", [k for k, spec in OBJECTIVES.items() if spec.flag_help])
def test_each_flag_chooses_its_kind(kind: str) -> None:
    code, output = _dry_run(f"--{kind}", *DATA[kind])
    assert code == 0, output
    assert _kind(output) == kind


def test_without_a_flag_the_recipe_chooses() -> None:
    code, output = _dry_run()
    assert code == 0 and _kind(output) == "gpt", output
    result = CliRunner().invoke(cli, ["train", "--dry-run", "--recipe", "tiny_dpo", *DATA["dpo"]])
    assert result.exit_code == 0 and _kind(result.output) == "dpo", result.output


def test_the_help_lists_the_registry_flags_and_options() -> None:
    result = CliRunner().invoke(cli, ["train", "--help"])
    assert "--objective [" + "|".join(OBJECTIVES) + "]" in result.output
    for spec in OBJECTIVES.values():
        assert (f"--{spec.kind} " in result.output) == (spec.flag_help is not None), spec.kind
        for option in spec.options:
            assert f"{option.name} {option.metavar}" in result.output


def test_two_objectives_are_refused() -> None:
    code, output = _dry_run("--objective", "sft", "--dpo", "--data", "x")
    assert code == 2 and "--objective sft and --dpo: choose one" in output, output


def test_an_option_of_another_objective_is_refused() -> None:
    code, output = _dry_run("--rollout-server", "http://127.0.0.1:9")
    assert code == 2, output
    assert "--rollout-server is for --grpo (data.kind = grpo)" in output


def test_objective_options_set_their_fields() -> None:
    grpo = [*DATA["grpo"], "--grpo"]
    code, output = _dry_run(*grpo)
    assert code == 0, output
    assert "reward_funcs = []" in output and 'rollout_server = ""' in output  # the defaults
    rewards = ["--reward-function", "m:f", "--reward-function", "n:g"]
    code, output = _dry_run(*grpo, *rewards, "--rollout-server", "http://127.0.0.1:9")
    assert code == 0, output
    assert 'reward_funcs = ["m:f", "n:g"]' in output
    assert 'rollout_server = "http://127.0.0.1:9"' in output
