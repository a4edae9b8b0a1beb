"""GRPO's rollouts ahead of training (`grpo.max_staleness = 1` with a rollout server) and
several rollout servers: a run whose next batch is generated while the current one trains
(each batch one weight version old, none dropped, the engine's log-probabilities the old ones)
keeps learning from the same prompts; with two servers named, one unreachable, the run is the
one-server run (same completions, rewards and losses) after a warning; a server that goes away
mid-batch has its requests resent to the others; the one-line refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.serve.engine.sampling import SamplingParams
from pipeline.train.config.schema import ConfigError
from pipeline.train.objectives.grpo import remote
from pipeline.train.objectives.grpo.ahead import RolloutsAhead
from tests.builders import records
from tests.train.test_grpo import _train, grpo_sets, task  # noqa: F401

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

from tests.serve.test_server import Server  # noqa: E402

FIGURES = ("reward/mean", "rewards/digits/std", "completions/mean_length", "entropy", "loss")


def test_ahead_and_two_servers_one_dead(tmp_path: Path, task: dict, grpo_start, caplog) -> None:  # noqa: F811
    start = grpo_start
    server = Server(start, tmp_path / "serve.txt", "--max-batch", "16", "--engine-threads", "1")
    try:
        url, load = f"http://127.0.0.1:{server.port}", f"checkpoint.load={start}"
        _train(grpo_sets(tmp_path / "one", task, load, f"grpo.rollout_server={url}"))
        dead = "http://127.0.0.1:9"
        _train(grpo_sets(tmp_path / "two", task, load, f"grpo.rollout_server={dead},{url}"))
        one, two = records(tmp_path / "one"), records(tmp_path / "two")
        for step, record in one.items():
            for figure in FIGURES:
                # the loss (about 1e-7 at a ratio of 1) carries the server's log-probabilities,
                # whose last bits depend on how the server happened to batch the requests
                close = 1e-6 if figure == "loss" else 1e-7
                assert two[step][figure] == pytest.approx(record[figure], rel=1e-5, abs=close)
        assert "127.0.0.1:9 cannot be reached" in caplog.text and "left out" in caplog.text
        sets = grpo_sets(tmp_path / "ahead", task, load, f"grpo.rollout_server={url}")
        _train([*sets, "grpo.max_staleness=1", "training.iters=4"])
        ahead = records(tmp_path / "ahead")
        assert set(ahead) == {1, 2, 3, 4}
        assert ahead[1]["async/staleness"] == 0  # the first batch: nothing was generated ahead
        for step in (2, 3, 4):  # each generated while the step before trained
            assert ahead[step]["async/staleness"] == 1 and ahead[step]["async/stale_dropped"] == 0
            assert ahead[step]["grad_norm"] > 0
            assert ahead[step]["sampling/sampling_logp_difference/mean"] > 0  # one version old
        assert ahead[1]["reward/mean"] == pytest.approx(one[1]["reward/mean"])  # same start
    finally:
        server.stop()


def test_a_server_lost_mid_batch_has_its_requests_resent(monkeypatch, caplog) -> None:
    rollouts = remote.RemoteRollouts.__new__(remote.RemoteRollouts)
    rollouts.urls = ["http://a", "http://b"]
    rollouts.alive, rollouts.url, rollouts.timeout = list(rollouts.urls), "http://a", 1.0
    rollouts._lock, rollouts._last_error = remote.threading.Lock(), None
    sent = []

    def send(self, url, body):
        sent.append((url, body["seed"]))
        if url == "http://a" and len([s for s in sent if s[0] == url]) > 1:
            raise remote.ServerDown("connection refused")
        choice = {"token_ids": [body["seed"]], "finish_reason": "stop", "logprobs": None}
        return {"choices": [choice], "usage": {}}

    monkeypatch.setattr(remote.RemoteRollouts, "_send", send)
    params = [[SamplingParams(4, seed=s) for s in range(6)]]
    with monkeypatch.context() as m:
        m.setattr(remote, "MAX_IN_FLIGHT", 1)
        outs = rollouts.generate([[1, 2, 3]], params)
    assert outs.completions == [[s] for s in range(6)]  # every request answered, in order
    assert rollouts.alive == ["http://b"] and "http://a cannot be reached" in caplog.text

    def gone(self, url, body):
        raise remote.ServerDown("gone")

    monkeypatch.setattr(remote.RemoteRollouts, "_send", gone)
    with pytest.raises(ConfigError, match="grpo.rollout_server http://b: gone"):
        rollouts.generate([[1]], [[SamplingParams(4, seed=0)]])


def test_a_stale_or_other_batch_is_dropped():
    ahead = RolloutsAhead(max_staleness=1)

    class Outs:
        completions = [[1], [2]]

    ahead.launch((0, 1), 3, lambda: Outs())
    outs, version, dropped = ahead.take((0, 1), 4)
    assert isinstance(outs, Outs) and version == 3 and dropped == 0
    ahead.launch((0, 1), 3, lambda: Outs())
    assert ahead.take((0, 1), 5) == (None, 5, 2)  # two versions old: over the bound
    ahead.launch((0, 1), 3, lambda: Outs())
    assert ahead.take((8, 9), 4) == (None, 4, 2)  # not this step's samples
    assert ahead.take((8, 9), 4) == (None, 4, 0)  # nothing ahead


@pytest.mark.parametrize(
    "extra,message",
    [
        (["grpo.max_staleness=1"], "set grpo.rollout_server"),
        (["grpo.max_staleness=-1"], "grpo.max_staleness must be >= 0"),
        (
            ["grpo.max_staleness=1", "grpo.rollout_server=http://x", "grpo.num_iterations=2"],
            "grpo.num_iterations 1",
        ),
    ],
)
def test_refused_in_one_line(tmp_path, task, extra, message):  # noqa: F811
    with pytest.raises(ConfigError, match=message):
        _train(grpo_sets(tmp_path / "run", task, *extra))


@pytest.mark.parametrize("staleness", [0, 1])
def test_resume_after_sigkill_with_a_server(
    tmp_path: Path,
    task: dict,  # noqa: F811
    grpo_start: Path,
    staleness: int,
) -> None:
    """Killed after saving iteration 2 and resumed: synchronous (staleness 0) it continues as
    the uninterrupted run did; one batch ahead it resumes (its first batch generated afresh, the
    one in flight lost with the process) and trains on."""
    import signal

    from tests.builders import kill_after_save

    start = grpo_start
    server = Server(start, tmp_path / "serve.txt", "--max-batch", "16", "--engine-threads", "1")
    try:
        url = f"http://127.0.0.1:{server.port}"
        extra = [
            "training.iters=4",
            "checkpoint.save_interval=2",
            f"grpo.rollout_server={url}",
            f"grpo.max_staleness={staleness}",
        ]
        run_a, run_b = tmp_path / "a", tmp_path / "b"
        _train(grpo_sets(run_a, task, f"checkpoint.load={start}", *extra))
        proc = kill_after_save(2, None, grpo_sets(run_b, task, f"checkpoint.load={start}", *extra))
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == -signal.SIGKILL, output
        _train(grpo_sets(run_b, task, *extra, f"checkpoint.load={run_b / 'checkpoints'}"))
        a, b = records(run_a), records(run_b)
        for step in (3, 4):
            assert b[step]["grad_norm"] > 0
            if staleness == 0:
                for key in ("loss", "grad_norm", "reward/mean", "completions/mean_length"):
                    expected = pytest.approx(a[step][key], rel=1e-5, abs=1e-6)
                    assert b[step][key] == expected, (step, key)
        if staleness:
            assert b[3]["async/staleness"] == 0 and b[4]["async/staleness"] == 1
    finally:
        server.stop()
