"""Adapters by name through `pipe serve` and the official `openai` client, against transformers +
peft: two adapters trained by `pipe train --lora` on a pipe checkpoint converted from a Hugging
Face directory and written by `pipe export --peft`.

- the export names the Hugging Face directory as its base, so peft's `AutoPeftModelForCausalLM`
  loads it alone, with pipe's logits; `--base-model` names another;
- served with `--lora-modules a=DIR b=DIR`, each adapter is a model in /v1/models (parent: the
  base) and one batch of requests for a, b and the base (all in flight together) gives each its
  transformers + peft greedy text;
- adapters loaded and unloaded (vLLM's routes and answers) while requests run lose none of them.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.loop.trainer import Trainer
from pipeline.weights.formats import open_source
from pipeline.weights.pipe_checkpoint import write_pipe_checkpoint
from tests.builders import run_pipe, served_text
from tests.serve.test_server import Server

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

PROMPTS = ["line 3: value", "def f(x):"]
NEW_TOKENS = 8


def train_adapters(base: Path, run_dir: Path, seed: int, targets: str) -> Path:
    """Two LoRA steps on mock tokens at a high learning rate (so the adapters change the
    text); returns the adapter checkpoints."""
    sets = [
        "data.mock=true",
        "data.seq_length=16",
        "data.num_workers=0",
        "training.iters=2",
        "training.micro_batch_size=2",
        "training.global_batch_size=2",
        "training.eval_interval=0",
        "training.log_interval=1",
        "training.dtype=fp32",
        "training.device=cpu",
        "optimizer.lr=0.3",
        "scheduler.warmup_iters=0",
        f"training.seed={seed}",
        f"checkpoint.load={base}",
        "lora.enabled=true",
        "lora.rank=4",
        "lora.alpha=8",
        f"lora.targets={targets}",
        f"logging.run_dir={run_dir}",
        "checkpoint.save_interval=2",
    ]
    Trainer(resolve_config(None, sets, {}), console=False).train()
    return run_dir / "checkpoints"


@pytest.fixture(scope="module")
def exported(tiny_hf_dir, tmp_path_factory):
    """{name: exported peft directory} for adapters a and b, and the pipe base."""
    root = tmp_path_factory.mktemp("lora_serve")
    base = root / "base"
    write_pipe_checkpoint(open_source(tiny_hf_dir, "hf"), base)
    runs = {"a": (1, '["q", "v", "down"]'), "b": (2, '["k", "o", "gate", "up"]')}
    out = {}
    for name, (seed, targets) in runs.items():
        adapters = train_adapters(base, root / f"run_{name}", seed, targets)
        run_pipe("export", adapters, "--peft", "-o", root / name)
        out[name] = root / name
    return out, base


def peft_greedy(hf_dir: Path, adapter: Path | None, prompt: str) -> str:
    """transformers (+ peft with `adapter`) greedy continuation of `prompt`, its text as vLLM
    (and `pipe serve`) write it."""
    from pipeline.tokenizer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    ids = torch.tensor([tokenizer.encode_batch([prompt])[0]])
    with torch.no_grad():
        out = model.eval().generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return served_text(hf_dir, ids[0].tolist(), out[0, ids.shape[1] :].tolist())


def test_auto_peft_loads_the_export_with_pipes_logits(tiny_hf_dir, exported, tmp_path) -> None:
    from pipeline.serve.engine.loading import open_generator

    adapters, base = exported
    config = json.loads((adapters["a"] / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_hf_dir)
    theirs = peft.AutoPeftModelForCausalLM.from_pretrained(adapters["a"]).eval()
    probe = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = open_generator(base, lora_adapter=adapters["a"]).model.eval()
    with torch.no_grad():
        difference = (ours.logits(probe).float() - theirs(input_ids=probe).logits).abs().max()
        plain = open_generator(base).model.logits(probe).float() - theirs(input_ids=probe).logits
    assert difference < 1e-4
    assert plain.abs().max() > 1e-2  # the adapters matter

    run = adapters["a"].parent / "run_a" / "checkpoints"
    result = run_pipe("export", run, "--peft", "--base-model", "org/tiny", "-o", tmp_path / "x")
    assert "base org/tiny" in result.output
    assert (
        json.loads((tmp_path / "x" / "adapter_config.json").read_text())["base_model_name_or_path"]
        == "org/tiny"
    )


@pytest.fixture(scope="module")
def server(exported, tmp_path_factory):
    adapters, base = exported
    log = tmp_path_factory.mktemp("lora_server") / "stderr.txt"
    server = Server(
        base,
        log,
        "--max-batch",
        "8",
        "--block-size",
        "8",
        "--kv-cache-mb",
        "4",
        "--engine-threads",
        "1",
        "--model-name",
        "base",
        "--lora-modules",
        f"a={adapters['a']}",
        f"b={adapters['b']}",
        "--max-loras",
        "2",
        "--allow-runtime-lora-updating",
    )
    yield server
    server.stop()


def post(server, path: str, body: dict) -> tuple[int, str]:
    """(status, body text): vLLM answers a load or unload with plain text, an error with JSON."""
    conn = server.connection()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read().decode()


def error(server, path: str, body: dict) -> tuple[int, str]:
    status, text = post(server, path, body)
    return status, json.loads(text)["error"]["message"]


def completion(client, model: str, prompt: str) -> str:
    answer = client.completions.create(
        model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0
    )
    assert answer.model == model
    return answer.choices[0].text


def test_adapters_by_name_in_one_mixed_batch(tiny_hf_dir, exported, server) -> None:
    adapters, _ = exported
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x")
    cards = {m.id: m for m in client.models.list().data}
    assert sorted(cards) == ["a", "b", "base"]
    assert cards["a"].parent == "base" and cards["a"].root == str(adapters["a"])
    jobs = [(model, prompt) for prompt in PROMPTS for model in ("a", "base", "b")]
    with ThreadPoolExecutor(len(jobs)) as pool:  # all in flight together: one batch
        texts = list(pool.map(lambda job: completion(client, *job), jobs))
    expected = [
        peft_greedy(tiny_hf_dir, None if model == "base" else adapters[model], prompt)
        for model, prompt in jobs
    ]
    assert texts == expected
    assert len(set(texts[:3])) == 3  # a, the base and b differ
    with pytest.raises(openai.NotFoundError, match="`c` does not exist"):
        completion(client, "c", "x")


def test_load_and_unload_while_requests_run(exported, server) -> None:
    """Requests for a running while c is loaded and a unloaded all finish with a's text; then
    a is a 404 and c answers; vLLM's error texts and codes for the wrong calls."""
    adapters, _ = exported
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x")
    long = {"model": "a", "prompt": PROMPTS[0], "max_tokens": 256, "temperature": 0}
    alone = client.completions.create(**long).choices[0].text
    streams = [client.completions.create(**long, stream=True) for _ in range(6)]
    firsts = [next(iter(stream)).choices[0].text for stream in streams]  # all admitted
    loaded = post(
        server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["a"])}
    )
    unloaded = post(server, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert server.get("/health")[1]["running"] > 0  # a's requests were still running
    texts = [
        first + "".join(c.choices[0].text for c in stream) for first, stream in zip(firsts, streams)
    ]
    assert texts == [alone] * 6  # none lost, none changed
    assert loaded == (200, "Success: LoRA adapter 'c' added successfully.")
    assert unloaded == (200, "Success: LoRA adapter 'a' removed successfully.")
    assert client.completions.create(**{**long, "model": "c"}).choices[0].text == alone
    with pytest.raises(openai.NotFoundError):
        completion(client, "a", PROMPTS[0])
    unload, load = "/v1/unload_lora_adapter", "/v1/load_lora_adapter"
    assert error(server, unload, {"lora_name": "a"}) == (
        404,
        "The lora adapter 'a' cannot be found.",
    )
    assert error(server, load, {"lora_name": "c", "lora_path": "x"}) == (
        400,
        "The lora adapter 'c' has already been loaded.",
    )
    assert error(server, load, {"lora_name": "d"}) == (
        400,
        "Both 'lora_name' and 'lora_path' must be provided.",
    )
    status, message = error(
        server, load, {"lora_name": "d", "lora_path": str(adapters["a"].parent)}
    )
    assert status == 400 and str(adapters["a"].parent) in message
