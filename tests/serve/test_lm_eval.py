"""lm-evaluation-harness against `pipe serve` with the harness's default settings (no
`tokenizer=`): a multiple-choice task and a generation task written as local JSON give the
per-request loglikelihoods (fp32, 1e-4), the accuracy and the greedy answers of lm-eval's own `hf`
model on the same Hugging Face directory; `pipe eval` gives the same figures."""

from __future__ import annotations

import json
import os

import pytest

from tests.serve.test_server import Server

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")

TASKS = ["pipe_tiny_mc", "pipe_tiny_gen"]
MC_DOCS = [
    {"question": f"line {i}: value=", "choices": [str(i * 7), str(i + 1), "abc"], "answer": i % 3}
    for i in range(2, 8)
]
GEN_DOCS = [{"question": f"line {i}: value={i * 7} ", "answer": "abc"} for i in range(1, 5)]
MC_YAML = """task: pipe_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_YAML = """task: pipe_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs: {{until: ["\\n"], max_gen_toks: 6, do_sample: false}}
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """The two tasks' YAMLs and JSONL documents (the harness cannot fetch hub data here)."""
    directory = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, docs, yaml in (("mc", MC_DOCS, MC_YAML), ("gen", GEN_DOCS, GEN_YAML)):
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (directory / f"{name}.yaml").write_text(yaml.format(data=data))
    return directory


@pytest.fixture(autouse=True, scope="module")
def offline():
    saved = dict(os.environ)
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    yield
    os.environ.clear()
    os.environ.update(saved)


def evaluate(model: str, args: dict, task_dir) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=args,
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        log_samples=True,
    )


def figures(results: dict) -> dict:
    """Per task: each document's answers (loglikelihoods per choice, or the generated text) and
    the task's score."""
    out = {}
    for task in TASKS:
        samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
        answers = [
            [r[0] if isinstance(r, list | tuple) else r for r in s["filtered_resps"]]
            for s in samples
        ]
        metric = "acc,none" if task.endswith("mc") else "exact_match,none"
        out[task] = (answers, results["results"][task][metric])
    return out


def assert_same(found: dict, expected: dict) -> None:
    mc_found, acc_found = found["pipe_tiny_mc"]
    mc_expected, acc_expected = expected["pipe_tiny_mc"]
    assert len(mc_found) == len(MC_DOCS)
    for got, want in zip(mc_found, mc_expected):
        assert [float(x) for x in got] == pytest.approx([float(x) for x in want], abs=1e-4)
    assert acc_found == acc_expected
    assert found["pipe_tiny_gen"] == expected["pipe_tiny_gen"]


@pytest.fixture(scope="module")
def hf_figures(tiny_hf_dir, task_dir):
    args = {"pretrained": str(tiny_hf_dir), "dtype": "float32", "device": "cpu"}
    return figures(evaluate("hf", args, task_dir))


def test_local_completions_with_defaults_match_hf(
    tiny_hf_dir, task_dir, hf_figures, tmp_path
) -> None:
    server = Server(tiny_hf_dir, tmp_path / "stderr.txt")
    try:
        assert server.get("/v1/models")[1]["data"][0]["id"] == str(tiny_hf_dir)
        url = f"http://127.0.0.1:{server.port}/v1/completions"
        found = figures(
            evaluate("local-completions", {"model": str(tiny_hf_dir), "base_url": url}, task_dir)
        )
    finally:
        server.stop()
    # The generated answers are vLLM's text of transformers' ids (a character cut at the end
    # left out), where lm-eval's `hf` model writes U+FFFD for it; the scores are the same.
    answers, score = hf_figures["pipe_tiny_gen"]
    assert_same(found, {**hf_figures, "pipe_tiny_gen": (served_answers(tiny_hf_dir), score)})
    assert any("\ufffd" in answer[0] for answer in answers)  # the case is exercised


def served_answers(directory) -> list[list[str]]:
    """What `pipe serve` answers the generation task: transformers' greedy ids (6 tokens) after
    each question, their text as vLLM writes it (`served_text`), cut at the task's "\n"."""
    import torch
    import transformers

    from pipeline.tokenizer.tokenizer import load_tokenizer
    from tests.builders import served_text

    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = load_tokenizer(directory)
    answers = []
    for doc in GEN_DOCS:
        ids = tokenizer.encode_batch([doc["question"]])[0]
        prompt = torch.tensor([ids])
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6)
        text = served_text(directory, ids, out[0, len(ids) :].tolist())
        answers.append([text.split("\n")[0]])
    return answers


def test_pipe_eval_gives_the_same_figures(tiny_hf_dir, task_dir, hf_figures, tmp_path) -> None:
    from click.testing import CliRunner

    from pipeline.serve.eval_command import evaluate

    output = tmp_path / "results.json"
    args = [
        str(tiny_hf_dir),
        "--tasks",
        ",".join(TASKS),
        "--include-path",
        str(task_dir),
        "--output",
        str(output),
        "--log-samples",
    ]
    done = CliRunner().invoke(evaluate, args)
    assert done.exit_code == 0, done.output[-3000:]
    assert "pipe_tiny_mc" in done.output  # the harness's table
    assert_same(figures(json.loads(output.read_text())), hf_figures)
    assert figures(json.loads(output.read_text()))["pipe_tiny_mc"][1] > 0  # not a trivial score
