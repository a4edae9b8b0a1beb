"""`pipe train --grpo --rollout-server URL`: the rollouts come from a running `pipe serve`, which
takes the policy's weights before each batch of rollouts; the run equals one whose rollouts
ran in the trainer (the same completions, rewards and losses), and the server ends on the
trained weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.builders import records
from tests.train.test_grpo import _pipe_train, _train, grpo_sets, task  # noqa: F401

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

from tests.serve.test_server import Server  # noqa: E402

FIGURES = ("reward/mean", "rewards/digits/std", "completions/mean_length", "entropy", "loss")


def test_rollouts_on_a_server_equal_rollouts_in_the_trainer(
    tmp_path: Path,
    task: dict,  # noqa: F811
    grpo_start: Path,
) -> None:
    start = grpo_start
    server = Server(start, tmp_path / "serve.txt", "--max-batch", "16", "--engine-threads", "1")
    try:
        url = f"http://127.0.0.1:{server.port}"
        load = f"checkpoint.load={start}"
        _train(grpo_sets(tmp_path / "local", task, load))
        _train(grpo_sets(tmp_path / "remote", task, load, f"grpo.rollout_server={url}"))
        local, remote = records(tmp_path / "local"), records(tmp_path / "remote")
        assert set(local) == set(remote) == {1, 2, 3}
        for step, record in local.items():
            for figure in FIGURES:
                expected = pytest.approx(record[figure], rel=1e-4, abs=1e-6)
                assert remote[step][figure] == expected, (step, figure)
        # The evaluation after the last step pushed the trained weights: the server answers
        # as the final checkpoint does.
        assert server.get("/weight_info")[1]["weight_version"].startswith("pipe-train-")
        ids = [3, 17, 5, 9, 28, 11]
        body = {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0}
        served = server.post("/v1/completions", body)[2]["choices"][0]["logprobs"]
        (final,) = (tmp_path / "remote" / "checkpoints").glob("iter_0000003")
        expected = _logprobs(final, ids)
        assert served["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=1e-5)
    finally:
        server.stop()


def test_an_unreachable_rollout_server_is_one_line(tmp_path: Path, task: dict) -> None:  # noqa: F811
    result = _pipe_train(tmp_path, task, "--rollout-server", "http://127.0.0.1:9")
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert "grpo.rollout_server http://127.0.0.1:9" in error, error


def _logprobs(checkpoint: Path, ids: list[int]) -> list[float]:
    """Each token's log-probability after the first under `checkpoint` (pipe's model, fp32)."""
    from pipeline.serve.engine.loading import open_generator

    model = open_generator(checkpoint, dtype=torch.float32).model
    with torch.no_grad():
        logits = model.logits(torch.tensor([ids])).float()
    picked = logits[0, :-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])
    return picked[:, 0].tolist()
