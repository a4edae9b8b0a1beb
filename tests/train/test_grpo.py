"""`pipe train --grpo`: rollouts from the current weights, rewards, the loss under each layout,
exact resume, and the one-line errors of a bad reward or config.

The prompts ask to continue `line N: value=` (the tiny test tokenizer's training text); a
reward of the test's own (`digits`: the share of digits in the completion, a user function
named "file.py:function") varies between completions of a random model, so every group has
advantages and every step a gradient.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.config.schema import ConfigError
from tests.builders import kill_after_save, records, run_pipe, train_and_probe, write_jsonl
from tests.distributed import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

REWARDS = """
def digits(prompts, completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]

def broken(prompts, completions, **kwargs):
    return [None if i else "many" for i, _ in enumerate(completions)]
"""


def write_task(directory: Path, tokenizer_dir: Path) -> dict:
    """The prompts (a held-out tenth), the tokenizer and the reward module of a micro run, the
    prompts and the rewards written in `directory`."""
    prompts = [{"prompt": f"line {i}: value=", "answer": str(i * 7)} for i in range(40)]
    (directory / "rewards.py").write_text(REWARDS)
    return {
        "prompts": write_jsonl(directory / "prompts.jsonl", prompts),
        "tokenizer": tokenizer_dir,
        "reward": f"{directory / 'rewards.py'}:digits",
    }


@pytest.fixture
def task(tmp_path: Path, tiny_tokenizer_dir: Path) -> dict:
    """The prompts (a held-out tenth), the tokenizer and the reward module of a micro run."""
    return write_task(tmp_path, tiny_tokenizer_dir)


def grpo_sets(run_dir: Path, task: dict, *extra: str) -> list[str]:
    """A micro GRPO run: 4 prompts x 4 completions of at most 8 tokens a step, fp32, CPU."""
    return [
        "model.num_layers=2",
        "model.hidden_size=32",
        "model.num_attention_heads=4",
        "model.num_kv_heads=2",
        "model.ffn_hidden_size=64",
        "model.vocab_size=640",
        "model.max_position_embeddings=64",
        "data.kind=grpo",
        f"data.blend={task['prompts']}",
        f"data.tokenizer={task['tokenizer']}",
        "data.split=90,10,0",
        "data.seq_length=48",
        "data.num_workers=0",
        "training.iters=3",
        "training.micro_batch_size=2",
        "training.global_batch_size=4",
        "training.eval_interval=3",
        "training.eval_iters=1",
        "training.log_interval=1",
        "training.dtype=fp32",
        "training.device=cpu",
        "scheduler.warmup_iters=1",
        "scheduler.decay_iters=5",
        "checkpoint.save_interval=3",
        f"logging.run_dir={run_dir}",
        "grpo.num_generations=4",
        "grpo.max_completion_length=8",
        f'grpo.reward_funcs=["accuracy", "{task["reward"]}"]',
        "grpo.temperature=1.5",
        *extra,
    ]


def _train(sets: list[str]):
    from pipeline.train.loop.trainer import Trainer

    return Trainer(resolve_config(None, sets), console=False).train()


def test_a_step_has_rollouts_rewards_and_a_gradient(grpo_default_run) -> None:
    result, run = grpo_default_run
    assert result.stop_reason == "finished"
    train, valid = records(run), records(run, "valid")
    for step in (1, 2, 3):
        figures = train[step]
        assert figures["grad_norm"] > 0
        assert 0 < figures["completions/mean_length"] <= figures["completions/max_length"] <= 8
        assert figures["rewards/digits/std"] > 0 and figures["frac_reward_zero_std"] < 1
        assert figures["rollout_tokens_per_s"] > 0 and 0 < figures["rollout_share"] < 1
        # The four completions of a prompt share its prefill: the engine ran each prompt of P
        # tokens once but its last token (P - 1 positions), then each completion's last prompt
        # token (4), and took the rest from the cache (3 x (P - 1)).
        computed, cached = figures["prompt_tokens_computed"], figures["prompt_tokens_cached"]
        assert cached > 0 and computed - 4 * 4 == cached / 3
    # Evaluation: one greedy completion per held-out prompt, its rewards reported.
    assert {"accuracy", "reward/mean", "rewards/digits/mean"} <= set(valid[3])


def test_bf16_rollouts_run_a_bf16_copy_outside_autocast(tmp_path: Path, task: dict) -> None:
    """With bf16 training the engine runs a bf16 copy of the policy (as `pipe serve` holds a
    model on a GPU), not the fp32 policy under the step's autocast, and its completions are
    those of the engine alone on a serving copy of the same weights."""
    import copy

    from pipeline.core.model.transformer import Transformer
    from pipeline.serve.engine.core import Engine
    from pipeline.serve.engine.sampling import SamplingParams
    from pipeline.train.objectives.grpo.rollout import RolloutModel

    cfg = resolve_config(None, grpo_sets(tmp_path, task, "training.dtype=bf16"))
    torch.manual_seed(0)
    policy = Transformer(cfg.model_config())
    policy.init_weights()
    rollout = RolloutModel(policy, cfg, torch.device("cpu"))
    assert rollout.module is not policy
    assert {p.dtype for p in rollout.module.parameters()} == {torch.bfloat16}
    assert rollout.module.rope.inv_freq.dtype == torch.float32
    autocast_seen = []
    rollout.module.register_forward_hook(
        lambda *_: autocast_seen.append(torch.is_autocast_enabled("cpu"))
    )
    prompts = [[5, 9, 14, 3], [7, 7, 2]]
    params = [[SamplingParams(8, 1.5, seed=10 * i + g) for g in range(3)] for i in range(2)]
    with torch.autocast("cpu", torch.bfloat16):  # as the step runs `prepare`
        rollout.refresh()
        outs = rollout.generate(prompts, params)
    assert autocast_seen and not any(autocast_seen)

    serving = copy.deepcopy(policy).to(torch.bfloat16)  # what `pipe serve` loads on a GPU
    serving.rope.init_weights()
    alone = Engine(serving, max_batch=6, cache_blocks=6, block_size=16).generate_groups(
        prompts, params
    )
    assert outs.completions == [r.output for group in alone for r in group]


def test_rollouts_after_a_step_never_read_the_old_weights_cache(tmp_path, task) -> None:
    """The engine is kept across steps, its prefix cache too; after the weights move (an
    optimizer step, then `refresh`) a prompt seen before is computed again: the same sharing
    as the first time, and the completions of a fresh engine on the new weights."""
    from pipeline.core.model.transformer import Transformer
    from pipeline.serve.engine.core import Engine
    from pipeline.serve.engine.sampling import SamplingParams
    from pipeline.train.objectives.grpo.rollout import RolloutModel

    cfg = resolve_config(None, grpo_sets(tmp_path, task))
    torch.manual_seed(0)
    policy = Transformer(cfg.model_config())
    policy.init_weights()
    rollout = RolloutModel(policy, cfg, torch.device("cpu"))
    prompts = [list(range(3, 40)), [7, 7, 2]]  # the first fills two blocks of 16
    params = [[SamplingParams(8, greedy=True) for _ in range(3)] for _ in prompts]
    rollout.refresh()
    first = rollout.generate(prompts, params)
    with torch.no_grad():  # what an optimizer step does to the weights
        for weight in policy.parameters():
            weight.add_(torch.randn_like(weight) * 0.05)
    rollout.refresh()
    second = rollout.generate(prompts, params)
    assert second.prompt_tokens_cached == first.prompt_tokens_cached
    alone = Engine(policy, max_batch=6, cache_blocks=12, block_size=16).generate_groups(
        prompts, params
    )
    assert second.completions == [r.output for group in alone for r in group]


@pytest.mark.parametrize(("value", "graphs"), [(None, None), ("off", False), ("on", True)])
def test_rollout_cuda_graphs_reach_the_engine(tmp_path, task, value, graphs) -> None:
    """`grpo.rollout_cuda_graphs` (default auto: on a CUDA device) is the rollout engine's
    `cuda_graphs`; on a CPU the engine decodes eagerly whatever it says; a bad value is refused
    in one line."""
    from pipeline.core.model.transformer import Transformer
    from pipeline.serve.engine.sampling import SamplingParams
    from pipeline.train.objectives.grpo.rollout import RolloutModel

    sets = grpo_sets(tmp_path, task) + ([f"grpo.rollout_cuda_graphs={value}"] if value else [])
    cfg = resolve_config(None, sets)
    assert cfg.grpo.rollout_cuda_graphs == (value or "auto")
    policy = Transformer(cfg.model_config())
    policy.init_weights()
    rollout = RolloutModel(policy, cfg, torch.device("cpu"))
    assert rollout.cuda_graphs is graphs
    outs = rollout.generate([[5, 9, 14]], [[SamplingParams(4, greedy=True)] * 2])
    assert len(outs.completions) == 2 and rollout.engine.decoder is None
    with pytest.raises(ConfigError, match="rollout_cuda_graphs") as error:
        resolve_config(None, [*sets, "grpo.rollout_cuda_graphs=yes"])
    assert "\n" not in str(error.value)
    remote = [*sets, "grpo.rollout_server=http://127.0.0.1:8000"]
    if value is None:
        resolve_config(None, remote)  # auto: the server decides
    else:
        with pytest.raises(ConfigError, match="has no effect with grpo.rollout_server"):
            resolve_config(None, [*remote, f"grpo.rollout_cuda_graphs={value}"])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_dry_run_estimate_holds_the_rollout_engine(tmp_path: Path, task: dict, dtype) -> None:
    """`--dry-run`'s rollout engine bytes are what the engine allocates for a step's longest
    rollouts: its weights (none when it runs on the fp32 policy itself) and KV cache."""
    from pipeline.core.model.transformer import Transformer
    from pipeline.serve.engine.sampling import SamplingParams
    from pipeline.train.objectives.grpo.rollout import RolloutModel
    from pipeline.train.report.estimates import estimate_memory

    cfg = resolve_config(None, grpo_sets(tmp_path, task, f"training.dtype={dtype}"))
    policy = Transformer(cfg.model_config())
    policy.init_weights()
    rollout = RolloutModel(policy, cfg, torch.device("cpu"))
    g = cfg.grpo
    prompt = [3] * (cfg.data.seq_length - g.max_completion_length)  # the longest a prompt may be
    params = [
        [SamplingParams(g.max_completion_length, seed=i)] * g.num_generations
        for i in range(cfg.training.global_batch_size)
    ]
    rollout.refresh()
    rollout.generate([prompt] * len(params), params)
    pools = rollout.engine.cache.pools
    allocated = sum(t.numel() * t.element_size() for layer in pools for t in layer)
    allocated -= sum(t[0].numel() * t.element_size() for layer in pools for t in layer)  # scratch
    if not rollout.shared:
        allocated += sum(p.numel() * p.element_size() for p in rollout.module.parameters())
    estimate = estimate_memory(cfg, cfg.model_config())
    assert estimate.held == allocated and "rollout engine" in estimate.held_what


# ---- layouts -------------------------------------------------------------------------------

LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "dp2": ["parallel.dp=2"],
    "dp2_batch_scale": ["parallel.dp=2", "grpo.scale_rewards=batch"],
}
FIGURES = ("reward/mean", "rewards/digits/std", "completions/mean_length", "entropy")


def _grpo_layout_worker(rank: int, world_size: int, tmp: Path, task: dict) -> dict:
    return {
        name: train_and_probe(None, grpo_sets(tmp / name, task, *extra))
        for name, extra in LAYOUTS.items()
    }


@pytest.mark.dist
def test_grpo_layouts_equal_one_process(tmp_path: Path, task: dict) -> None:
    """Tensor and FSDP data parallelism draw the same rollouts (each completion its own seed)
    and give the same losses, figures and gradients as one process."""
    single = {
        "plain": train_and_probe(None, grpo_sets(tmp_path / "single", task)),
        "batch_scale": train_and_probe(
            None, grpo_sets(tmp_path / "single_batch", task, "grpo.scale_rewards=batch")
        ),
    }
    per_rank = run_distributed(_grpo_layout_worker, 2, tmp_path / "dist", task)
    for name in LAYOUTS:
        key, run = ("batch_scale", "single_batch") if "batch" in name else ("plain", "single")
        reference = single[key]
        for result in (r[name] for r in per_rank):
            for step, loss in reference["losses"].items():
                assert result["losses"][step] == pytest.approx(loss, rel=1e-4, abs=1e-7), name
            for param, grad in reference["grads"].items():
                torch.testing.assert_close(result["grads"][param], grad, atol=1e-6, rtol=1e-4)
        figures = records(tmp_path / "dist" / name)
        for step, record in records(tmp_path / run).items():
            for figure in FIGURES:
                expected = pytest.approx(record[figure], rel=1e-4, abs=1e-6)
                assert figures[step][figure] == expected, (name, step, figure)


def _recorded_run(sets: list[str]) -> dict:
    """Train as `sets` say; the rollouts of every step and evaluation on this rank (as they go
    into rows) and the requests its engine ran."""
    from pipeline.train.loop.trainer import Trainer
    from pipeline.train.objectives.grpo import objective as grpo

    seen, into_rows = [], grpo.rollout_rows

    def recording(outs, *args):
        seen.append(
            (
                outs.prompts,
                outs.completions,
                outs.truncated,
                outs.prompt_tokens_computed,
                outs.prompt_tokens_cached,
            )
        )
        return into_rows(outs, *args)

    grpo.rollout_rows = recording
    try:
        trainer = Trainer(resolve_config(None, sets), console=False)
        trainer.train()
    finally:
        grpo.rollout_rows = into_rows
    return {"rollouts": seen, "requests": trainer.objective.rollout.engine.finish_counts.total()}


def _tp2_rollouts_worker(rank: int, world_size: int, tmp: Path, task: dict) -> dict:
    return _recorded_run(grpo_sets(tmp / "tp2", task, "parallel.tp=2", "training.iters=2"))


@pytest.mark.dist
def test_tp_ranks_each_generate_a_share_of_the_rollouts(tmp_path: Path, task: dict) -> None:
    """Under tp2 each rank's engine draws half the completions (the tp ranks hold the same
    prompts) and, after the exchange, every rank holds the rollouts one process draws, in its
    order, with the whole batch's prefill counts."""
    single = _recorded_run(grpo_sets(tmp_path / "single", task, "training.iters=2"))
    per_rank = run_distributed(_tp2_rollouts_worker, 2, tmp_path / "dist", task)
    assert len(single["rollouts"]) >= 2 and single["requests"] % 2 == 0
    for result in per_rank:
        assert result["requests"] == single["requests"] // 2
        assert result["rollouts"] == single["rollouts"]


class _Echo:
    """A rollout source whose completion is the prompt's last token and the parameter, and
    which keeps the prompts it was asked for; like the engine, it takes no empty batch."""

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def generate(self, prompts, params):
        from pipeline.train.objectives.grpo.rollout import Rollouts

        if not prompts:
            raise ValueError("no prompts")
        self.asked += prompts
        rows = [(p, [p[-1], each]) for p, group in zip(prompts, params) for each in group]
        return Rollouts(
            prompts=[p for p, _ in rows],
            completions=[c for _, c in rows],
            truncated=[c[1] % 2 == 1 for _, c in rows],
            prompt_tokens_computed=len(prompts),
            prompt_tokens_cached=len(rows),
        )


UNEVEN = [
    ([[1], [2, 2], [3]], [[10, 11], [20], [30, 31, 32]]),  # groups of different sizes
    ([[4, 5]], [[40, 41]]),  # one group: the second rank draws nothing
]


def _split_worker(rank: int, world_size: int, tmp: Path) -> list:
    import torch.distributed as dist

    from pipeline.train.objectives.grpo.split import generate_split

    results = []
    for prompts, params in UNEVEN:
        echo = _Echo()
        outs = generate_split(echo, prompts, params, dist.group.WORLD)
        results.append((echo.asked, vars(outs) | {"seconds": None}))
    return results


@pytest.mark.dist
def test_split_rollouts_come_back_in_order_whatever_the_shares(tmp_path: Path) -> None:
    """`generate_split` over 2 ranks: rank r asks for the groups r, r + 2, ...; every rank
    gets the rollouts of all groups in order, the counters summed, whether the groups differ
    in size or a rank has none."""
    per_rank = run_distributed(_split_worker, 2, tmp_path)
    for case, (prompts, params) in enumerate(UNEVEN):
        alone = vars(_Echo().generate(prompts, params)) | {"seconds": None}
        for rank, results in enumerate(per_rank):
            asked, outs = results[case]
            assert asked == prompts[rank::2] and outs == alone, (case, rank)


# ---- resume --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [[], ["grpo.beta=0.05", "grpo.num_iterations=2", "grpo.loss_type=grpo"]],
    ids=["plain", "kl_and_passes"],
)
def test_grpo_resumes_exactly_after_sigkill(tmp_path: Path, task: dict, extra: list) -> None:
    """Killed after saving iteration 2 and resumed, a GRPO run draws the rollouts the
    uninterrupted one drew (the sampling state is the iteration) and continues bit for bit;
    with beta the frozen start is rebuilt from the record in the checkpoint."""
    extra = ["training.iters=4", "checkpoint.save_interval=2", *extra]
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    _train(grpo_sets(run_a, task, *extra))
    proc = kill_after_save(2, None, grpo_sets(run_b, task, *extra))
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, output
    _train(grpo_sets(run_b, task, *extra, f"checkpoint.load={run_b / 'checkpoints'}"))
    a, b = records(run_a), records(run_b)
    for step in (3, 4):  # with two passes, step 4 trains on step 3's rollouts again
        for key in ("loss", "grad_norm", "reward/mean", "completions/mean_length"):
            assert a[step].get(key) == b[step].get(key), (step, key)
    assert "reward/mean" in b[3]
    if extra[2:]:
        metadata = json.loads(
            (run_b / "checkpoints" / "iter_0000004" / "pipe_metadata.json").read_text()
        )["metadata"]
        assert metadata["grpo_reference"]["load"] is None  # the seeded start
        assert a[1]["kl"] == pytest.approx(0.0, abs=1e-7)  # the policy is its start at step 1
        assert a[3]["kl"] > 0  # (the first step, in warmup, has a learning rate of 0)


# ---- errors in one line ----------------------------------------------------------------------


def _pipe_train(tmp_path: Path, task: dict, *flags: str):
    """`pipe train --grpo FLAGS` of one step of the micro run."""
    sets = grpo_sets(tmp_path / "run", task, "training.iters=1", "grpo.reward_funcs=[]")
    args = [a for s in sets if not s.startswith("data.kind") for a in ("--set", s)]
    return run_pipe("train", "--grpo", *args, *flags, expect_ok=False)


def test_a_reward_returning_a_non_number_is_named_with_its_prompt(tmp_path, task) -> None:
    broken = task["reward"].replace(":digits", ":broken")
    result = _pipe_train(tmp_path, task, "--reward-function", broken)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert "prompts.jsonl:" in error and "broken" in error, error


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["parallel.pp=2"], "without pipeline, context or expert parallelism"),
        (["grpo.num_generations=1"], "num_generations must be at least 2"),
        (["grpo.max_completion_length=48"], "leave room for a prompt"),
        (["grpo.num_iterations=2", "checkpoint.save_interval=3"], "multiple of grpo.num_iter"),
        (['grpo.reward_funcs=["nowhere:reward"]'], "nowhere"),
    ],
)
def test_grpo_config_refused_in_one_line(tmp_path, task, extra, message) -> None:
    with pytest.raises(ConfigError, match=message):
        _train(grpo_sets(tmp_path / "run", task, *extra))


def test_lora_grpo_takes_the_base_as_its_reference(tmp_path: Path, task: dict) -> None:
    """With --lora the KL anchor is the policy with its adapters off: no second model, and at
    the first step (adapters B = 0) the KL is 0."""
    _train(grpo_sets(tmp_path / "run", task, "lora.enabled=true", "lora.rank=4", "grpo.beta=0.1"))
    train = records(tmp_path / "run")
    assert train[1]["kl"] == pytest.approx(0.0, abs=1e-7)
    assert train[3]["kl"] > 0 and train[3]["grad_norm"] > 0


def test_grpo_starts_from_a_hugging_face_directory(tmp_path: Path, task: dict) -> None:
    """`--load HF_DIR`: GRPO starts from a Hugging Face model (here one a GRPO run saved) and
    its KL anchor is that model: 0 at the first step, recorded as the start."""
    _train(grpo_sets(tmp_path / "first", task, "checkpoint.save_hf=final"))
    (hf_dir,) = (tmp_path / "first" / "checkpoints" / "hf").iterdir()
    _train(grpo_sets(tmp_path / "second", task, f"checkpoint.load={hf_dir}", "grpo.beta=0.1"))
    second = records(tmp_path / "second")
    assert second[1]["kl"] == pytest.approx(0.0, abs=1e-7) and second[3]["kl"] > 0
    (saved,) = (tmp_path / "second" / "checkpoints").glob("iter_*/pipe_metadata.json")
    metadata = json.loads(saved.read_text())["metadata"]
    assert metadata["grpo_reference"]["load"] == str(hf_dir.resolve())


def test_skip_train_evaluates_the_start_and_saves_nothing(tmp_path: Path, task: dict) -> None:
    """`training.skip_train` (Megatron's --skip-train): one evaluation of the loaded weights,
    logged at their iteration, no step and no checkpoint: the start a run is compared with."""
    result = _train(grpo_sets(tmp_path / "run", task, "training.skip_train=true"))
    assert result.stop_reason == "evaluated" and result.iteration == 0
    assert set(records(tmp_path / "run", "valid")) == {0} and not records(tmp_path / "run")
    assert not list((tmp_path / "run").glob("checkpoints/iter_*"))
