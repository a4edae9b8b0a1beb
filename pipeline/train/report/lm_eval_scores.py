"""lm-evaluation-harness tasks scored during training (`[eval] lm_eval_tasks` every
`lm_eval_interval` iterations), on the training model itself: no export and no second server.

The harness's requests are answered as `pipe eval`'s `local-completions` model has them answered
by `pipe serve`: a loglikelihood is the sum of the continuation's token log-probabilities over
`(context + continuation)[-max_length:]`, "greedy" when each of those tokens is the argmax, and a
generation is the greedy continuation (`pipeline.core.model.greedy`) cut at the first stop
string, special tokens skipped in the text. So the scores equal `pipe eval` on the run's exported
checkpoint. Like the training samples it runs where the model is one module (a one-device run);
under a parallel layout it is skipped with one warning. lm-eval is an optional extra.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.common.lm_eval_tasks import task_manager
from pipeline.common.quiet import quiet_lm_eval
from pipeline.core.model.greedy import greedy_without_cache
from pipeline.train.config.schema import ConfigError, TrainConfig
from pipeline.train.report.samples import sample_tokenizer_path

log = logging.getLogger(__name__)

_BATCH_ROWS = 32  # sequences per forward when scoring loglikelihoods
FEWSHOT_SEED = 1234  # `simple_evaluate`'s default `fewshot_random_seed`, what `pipe eval` runs


def _harness_model_class():
    """lm-eval's `TemplateLM` answering from a model in this process (made here so lm-eval is
    imported only by runs that ask for it)."""
    from lm_eval.api.model import TemplateLM

    class TrainingModelLM(_TrainingModelAnswers, TemplateLM):
        """The harness's model: the training `Transformer` and its tokenizer."""

    return TrainingModelLM


class _TrainingModelAnswers:
    """The answers of `TrainingModelLM` to the harness's requests (mixed in before lm-eval's
    `TemplateLM`, which brings the requests' tokenization and the rest)."""

    def __init__(self, model, tokenizer, device, max_length: int) -> None:
        super().__init__()
        self.model, self.tokenizer, self.device_ = model, tokenizer, device
        self.max_length = max_length

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod or 0

    def tok_encode(self, string: str, **kwargs) -> list[int]:
        return self.tokenizer.encode_batch([string])[0]

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
        # sequences of one length run as one batch: no padding, so each row is what it
        # would be alone
        rows = [self._scored_tokens(context, continuation) for _, context, continuation in requests]
        by_length: dict[int, list[int]] = {}
        for index, (tokens, _) in enumerate(rows):
            by_length.setdefault(len(tokens), []).append(index)
        answers: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for indices in by_length.values():
            for first in range(0, len(indices), _BATCH_ROWS):
                batch = indices[first : first + _BATCH_ROWS]
                ids = torch.tensor([rows[i][0] for i in batch], device=self.device_)
                logprobs = F.log_softmax(self.model.logits(ids)[:, :-1].float(), dim=-1)
                for row, index in enumerate(batch):
                    answers[index] = _continuation_score(logprobs[row], ids[row], rows[index][1])
        return answers

    def _scored_tokens(self, context: list[int], continuation: list[int]) -> tuple[list, int]:
        """`(context + continuation)` cut on the left to `max_length`, and the position of
        the continuation's first token in it (`pipe eval`'s `local-completions` cut)."""
        tokens = (context + continuation)[-self.max_length :]
        return tokens, len(tokens) - len(continuation)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils

        scores = []
        for (text,) in [r.args for r in requests]:
            windows = utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length - 1,
                context_len=1,
            )
            pairs = [(None, *utils.make_disjoint_window(w)) for w in windows]
            scores.append(sum(s for s, _ in self._loglikelihood_tokens(pairs)))
        return scores

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from lm_eval.models.utils import handle_stop_sequences

        eos = self.tokenizer.decode([self.eot_token_id])
        answers = []
        for context, options in [r.args for r in requests]:
            stops = handle_stop_sequences(dict(options).get("until"), eos)
            budget = dict(options).get("max_gen_toks", 256)
            prompt = self.tok_encode(context)[-(self.max_length - budget) :]
            answers.append(self._greedy_text(prompt, budget, stops))
        return answers

    def _greedy_text(self, prompt: list[int], budget: int, stops: list[str]) -> str:
        """The greedy continuation's text (special tokens skipped) before the first stop."""
        ends = frozenset({self.tokenizer.eod} - {None})
        output = greedy_without_cache(self.model, prompt, budget, ends, self.device_)
        text = self.tokenizer.decode(output, skip_special_tokens=True)
        cut = min([text.find(s) for s in stops if s and s in text], default=len(text))
        return text[:cut]


def _continuation_score(
    logprobs: torch.Tensor, ids: torch.Tensor, start: int
) -> tuple[float, bool]:
    """The summed log-probability of `ids[start:]` under `logprobs` (`[len(ids) - 1, vocab]`,
    row i predicting token i + 1), and whether each of those tokens is the most likely one."""
    rows, targets = logprobs[start - 1 :], ids[start:]
    picked = rows.gather(1, targets[:, None])[:, 0]
    return float(picked.sum()), bool((rows.argmax(dim=-1) == targets).all())


class InLoopEvaluation:
    """lm-eval's tasks on the training model, as `{"<task>/<metric>": score}` for the log.

    The tasks are loaded once, when the run starts (their documents read), and each evaluation
    runs lm-eval's `evaluate` on them with the settings `pipe eval`'s `simple_evaluate` gives
    them: zero-shot unless the task says otherwise, the harness's few-shot seed set again
    before each evaluation so every evaluation asks the same questions. `simple_evaluate`
    itself is not called: it would load the tasks again, collect the machine's environment for
    its report, and reseed Python's, NumPy's and torch's global generators in the middle of the
    run.
    """

    def __init__(
        self,
        tasks: list[str],
        tokenizer_path: Path,
        max_length: int,
        limit: float | None = None,
        include_path: str | None = None,
    ) -> None:
        try:
            import lm_eval.tasks  # noqa: F401
        except ImportError:
            raise ConfigError("eval.lm_eval_tasks needs: pip install 'pipe-llm[eval]'") from None
        from pipeline.tokenizer.tokenizer import load_tokenizer

        self.manager = task_manager(tasks, include_path)
        unknown = [t for t in tasks if t not in self.manager.all_tasks]
        if unknown:
            raise ConfigError(f"eval.lm_eval_tasks: unknown lm-eval task {unknown[0]!r}")
        self.tasks, self.limit, self.max_length = tasks, limit, max_length
        self.tokenizer = load_tokenizer(tokenizer_path)
        try:
            with quiet_lm_eval():
                self.loaded = self.manager.load(tasks)
        except (OSError, ValueError) as error:  # a dataset that cannot be found or read
            raise ConfigError(f"eval.lm_eval_tasks: cannot load the tasks: {error}") from None
        for task in self.loaded["tasks"].values():
            if task.get_config("num_fewshot") is None:
                task.set_config(key="num_fewshot", value=0)

    def scores(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        """The tasks' metrics on `model`, one ordinary module on `device`."""
        from lm_eval.evaluator import evaluate

        harness_model = _harness_model_class()(model, self.tokenizer, device, self.max_length)
        for task in self.loaded["tasks"].values():
            task.set_fewshot_seed(seed=FEWSHOT_SEED)
        was_training = model.training
        model.eval()
        try:
            with quiet_lm_eval():
                # no standard errors (the log keeps none), no per-document samples
                results = evaluate(
                    lm=harness_model,
                    task_dict=self.loaded,
                    limit=self.limit,
                    bootstrap_iters=0,
                    log_samples=False,
                )
        finally:
            model.train(was_training)
        return flat_scores(results["results"])


def build_lm_eval(
    cfg: TrainConfig, model_config: Any, tokenizer: Any, world_size: int
) -> InLoopEvaluation | None:
    """The run's in-loop evaluation: None when `[eval]` asks for none, or (after one warning)
    when the model is split over devices."""
    e = cfg.eval
    if not (e.lm_eval_tasks and e.lm_eval_interval):
        return None
    if world_size > 1:
        log.warning("lm-eval tasks run on one device only; skipped in this layout")
        return None
    try:
        path = sample_tokenizer_path(cfg.data.tokenizer, tokenizer.fingerprint)
    except ConfigError:
        raise ConfigError(
            "eval.lm_eval_tasks needs the data's tokenizer: set data.tokenizer"
        ) from None
    max_length = e.lm_eval_max_length or model_config.max_position_embeddings
    return InLoopEvaluation(
        e.lm_eval_tasks, path, max_length, e.lm_eval_limit, e.lm_eval_include_path
    )


def flat_scores(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """`{"task/metric": value}` of lm-eval's per-task results, numbers only (`acc,none` becomes
    `acc`; standard errors, counts and aliases are left out)."""
    flat = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            name, comma, kind = key.partition(",")  # metrics are "name,filter"; others are not
            if not comma or name.endswith("_stderr") or isinstance(value, (bool, str)):
                continue
            suffix = "" if kind == "none" else f"_{kind}"
            flat[f"lm_eval/{task}/{name}{suffix}"] = float(value)
    return flat
