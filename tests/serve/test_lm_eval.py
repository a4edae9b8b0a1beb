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
    # and nothing else of lm-eval's: its warnings about the tasks' defaults, its bars
    assert "aggregation is not" not in done.output and "Tokenizing" not in done.output
    assert_same(figures(json.loads(output.read_text())), hf_figures)
    assert figures(json.loads(output.read_text()))["pipe_tiny_mc"][1] > 0  # not a trivial score


def test_the_eval_server_replies_without_waiting_for_acks(tiny_hf_dir) -> None:
    """`pipe eval`'s server (in this process) accepts each connection with Nagle's algorithm
    off, as `pipe serve` does: with it on, every small reply (the harness tokenizes each
    request through /tokenize, one call at a time) waited ~40 ms for the client's delayed ACK,
    and a 400-request task took 44.9 s instead of 8.2 s."""
    import asyncio
    import gc
    import socket

    import requests

    from pipeline.serve.engine.process import EngineSpec
    from pipeline.serve.http.harness import serving

    spec = EngineSpec(str(tiny_hf_dir), None, "cpu", "fp32", 2**24, 16, 4, 256)
    with serving(spec, "tiny") as (base_url, _), requests.Session() as session:
        reply = session.post(f"{base_url}/tokenize", json={"prompt": "line 2: value="})
        assert reply.ok and reply.json()["tokens"]
        port = int(base_url.rsplit(":", 1)[1])
        accepted = [
            found.get_extra_info("socket")
            for found in gc.get_objects()
            if issubclass(type(found), asyncio.Transport)  # type(): no proxy asked its class
            and not found.is_closing()
            and (found.get_extra_info("sockname") or (None, None))[1] == port
        ]
        assert accepted, "the connection the server accepted"
        for sock in accepted:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_pipe_eval_counts_the_requests_answered() -> None:
    """On a terminal `pipe eval` shows its own bar of the requests the engine answered (what the
    engine client counts as finished), where lm-eval's bars are held back."""
    import io
    import time
    from collections import Counter
    from types import SimpleNamespace
    from unittest import mock

    from tqdm import tqdm

    from pipeline.serve.http import harness

    client = SimpleNamespace(finish_counts=Counter())
    shown = io.StringIO()

    def bar(total, *, desc, **options):
        return tqdm(total=total, desc=desc, file=shown, **options)

    with mock.patch("pipeline.common.progress.terminal_bar", bar), harness.answered_bar(client):
        client.finish_counts.update(stop=2)
        time.sleep(0.7)  # refreshed twice a second
        assert "pipe eval: 2 requests" in shown.getvalue()
        client.finish_counts.update(length=1)
    assert shown.getvalue().split("\r")[-1].startswith("pipe eval: 3 requests")  # at the end
