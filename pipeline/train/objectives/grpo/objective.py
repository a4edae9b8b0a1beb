"""The GRPO objective (`data.kind = "grpo"`, `pipe train --grpo`): reinforcement learning with
verifiable rewards, rollouts generated in the training processes.

A sample is one prompt (`pipeline.data.prompt_dataset`). Before a step's forward passes
(`prepare`) every prompt of this rank's share of the global batch gets `num_generations`
completions from the current weights (`rollout`; under tensor parallelism each tp rank
draws a share of them and the ranks exchange the rest, `split`), each completion its rewards
(`rewards`), each group of completions its advantages, and the micro-batch its rows:
prompt and completion, the loss mask on the completion's tokens, the advantages, and, when
needed, the log-probabilities of the weights that sampled them (`num_iterations` > 1) and of
the frozen start (`beta` > 0). With `num_iterations` > 1 the same rollouts serve that many
optimizer steps (the prompt dataset repeats each global batch as often, so every pass sees
the same prompts on the same ranks).

The loss is TRL's (`loss`), its gradient taken as DPO's is: the token log-probabilities
come from one fused pass without gradients, the loss's derivative by each of them from a small
autograd graph on a leaf, and the model's gradient from the chunked cross-entropy with the
mask weighed by that derivative, so full-vocabulary logits never exist and tensor parallelism
(a vocabulary-parallel output layer) works as it does for the language-model loss.

Evaluation (the valid split) generates one greedy completion per prompt and reports its
rewards (held-out accuracy); its loss has no advantages to weigh and is not a figure to read.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pipeline.core.parallel.tensor_parallel import tp_linear_cross_entropy
from pipeline.train.config.schema import ConfigError
from pipeline.train.objectives.base import Batch, Objective
from pipeline.train.objectives.frozen_start import ReferenceRecord, frozen_start
from pipeline.train.objectives.grpo.correction import (
    CorrectionOptions,
    correction_on,
    importance_ratio,
    mismatch_figures,
)
from pipeline.train.objectives.grpo.logprobs import token_logprobs
from pipeline.train.objectives.grpo.loss import (
    GRPOLossOptions,
    group_advantages,
    loss_count,
    nanstd,
    per_token_loss,
    reduce_loss,
    weighted_rewards,
)
from pipeline.train.objectives.grpo.metrics import RunningFigures
from pipeline.train.objectives.grpo.rollout import RolloutModel, completion_seed, rollout_rows
from pipeline.train.objectives.grpo.split import generate_split

if TYPE_CHECKING:
    from pipeline.train.objectives.grpo.remote import RemoteRollouts

__all__ = ["GRPO"]

log = logging.getLogger("pipeline.train")

PROMPT_KEYS = ("prompt", "prompt_length", "prompt_index", "sample_index")


class GRPO(Objective):
    """Group relative policy optimisation and its variants; see the module docstring."""

    batch_keys = PROMPT_KEYS
    reports_perplexity = False

    def __init__(self, cfg: Any, spec: Any, *, layout: Any) -> None:
        super().__init__(cfg, spec, layout=layout)
        self.section = cfg.grpo
        self.options = GRPOLossOptions.from_section(cfg.grpo)
        for warning in self.options.warnings():
            log.warning("%s", warning)
        self.correction = CorrectionOptions.from_section(cfg.grpo)
        self.ahead: Any = None  # with max_staleness >= 1: the batch generated ahead
        if cfg.grpo.max_staleness:
            from pipeline.train.objectives.grpo.ahead import RolloutsAhead

            self.ahead = RolloutsAhead(cfg.grpo.max_staleness)
        # generating ahead, the engine's log-probabilities are the old ones: no second correction
        self.correct = correction_on(cfg) and self.ahead is None
        self.run: Any = None
        self.rollout: RolloutModel | RemoteRollouts | None = None
        self.reference: Any = None  # a runner whose hidden states are the frozen start's
        self.record = ReferenceRecord("grpo_reference", "GRPO")
        self.rewards: Any = None
        self.text: Any = None  # the tokenizer completions are decoded with
        self.figures = RunningFigures()
        self._evaluating = False
        self._kept: list[dict[str, torch.Tensor]] | None = None  # rollouts reused by later passes
        self._refreshed_at: int | None = None  # the iteration the rollout weights are from
        self._window_start = time.perf_counter()
        self._examples: list[str] = []
        self.agent: Any = None  # with tools: the multi-turn rollouts (`agent.Agent`)
        self.tools: list[Any] = []
        self.environment: type | None = None
        self._environments: list[Any] = []  # instances, one per rollout of a batch, reused

    def records(self) -> list[Any]:
        """The frozen start, when the KL term needs one."""
        return [self.record] if self.options.beta else []

    # ---- setup ------------------------------------------------------------------------------

    def setup(self, run: Any) -> None:
        """The rollout model, the rewards, the tokenizer and (beta > 0) the reference."""
        from pipeline.tokenizer.chat_template import eos_token_ids, load_chat_template
        from pipeline.tokenizer.tokenizer import load_tokenizer
        from pipeline.train.objectives.grpo.rewards import build_rewards

        self.run, self._refreshed_at = run, None
        if self.section.rollout_server:
            from pipeline.train.objectives.grpo.remote import RemoteRollouts

            self.rollout = RemoteRollouts(self.section.rollout_server, run.model, self.layout)
        else:
            self.rollout = RolloutModel(run.model, self.cfg, run.device)
        records = run.datasets[0].records
        if self.section.tools or self.section.environment:
            from pipeline.train.objectives.grpo.tools import offered_tools

            self.tools, self.environment = offered_tools(self.section)
        self.text = load_tokenizer(self.cfg.data.tokenizer)
        answers = any("answer" in r.fields for r in records)
        self.rewards = build_rewards(
            self.section, answers, self.text.encode_batch, self.environment, self.text.decode
        )
        template = load_chat_template(self.cfg.data.tokenizer)
        self.stop_ids = frozenset({self.text.eod} - {None} | eos_token_ids(template, self.text))
        if self.section.tools or self.section.environment:
            self.agent = self._agent(template)
        if self.options.beta:
            self.reference = frozen_start(run, self.record)

    def _agent(self, template: Any) -> Any:
        """The multi-turn rollouts of a run with tools (`agent`)."""
        from pipeline.train.objectives.grpo.agent import Agent, choose_parser
        from pipeline.train.objectives.grpo.data import tool_renderer

        s = self.section
        try:
            parser = choose_parser(s.tool_call_parser, template.source(tools=True))
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self._render = tool_renderer(self.cfg, template)
        return Agent(
            parser=parser,
            template=template,
            tokenizer=self.text,
            stop_ids=self.stop_ids,
            max_completion_length=s.max_completion_length,
            max_iterations=s.max_tool_calling_iterations,
            timeout=s.tool_timeout,
        )

    # ---- the loop's calls -------------------------------------------------------------------

    def device_batch(self, batch: dict[str, torch.Tensor], device: torch.device, eod_id: Any):
        """The prompts stay on the host until `prepare` turns them into rows."""
        return {key: batch[key] for key in self.batch_keys}

    def count(self, batch: Batch) -> torch.Tensor:
        return loss_count(batch["loss_mask"], self.options.loss_type)

    def prepare(self, micro_batches: Sequence[Batch], runner: Any) -> None:
        """Rollouts, rewards and advantages into each micro-batch's rows (module docstring)."""
        passes, iteration = self.section.num_iterations, self.run.iteration
        if self._evaluating or passes == 1 or iteration % passes == 0 or not self._kept:
            if not self._evaluating and iteration % passes:  # a run resumed from a signal's save
                log.warning(
                    "iteration %d is a later pass over rollouts this run no longer holds: new "
                    "rollouts serve the rest of their passes",
                    iteration,
                )
            rows = self._rollout_rows(micro_batches, runner)
            if not self._evaluating and passes > 1:
                self._kept = rows
        else:
            rows = self._kept
        for batch, filled in zip(micro_batches, rows):
            batch.clear()
            batch.update(filled)

    def loss(self, model: Any, hidden: torch.Tensor, batch: Batch):
        """(summed GRPO loss, its count) of a micro-batch; the gradient through the fused
        cross-entropy weighed by the loss's derivative by each token's log-probability."""
        weight, labels, mask = model.output.weight, batch["labels"], batch["loss_mask"]
        logps, entropy = token_logprobs(hidden, weight, labels)
        logps, entropy = logps.view_as(mask) * mask, entropy.view_as(mask) * mask
        is_ratio = self._mismatch(logps.detach(), batch)
        with torch.enable_grad():
            leaf = logps.detach().requires_grad_(True)
            token_losses, stats = per_token_loss(
                leaf,
                batch.get("old_logps"),
                batch.get("ref_logps"),
                batch["advantages"],
                mask,
                self.options,
                is_ratio,
            )
            loss_sum, count = reduce_loss(token_losses, mask, self.options)
            slope = torch.autograd.grad(loss_sum, leaf)[0] if hidden.requires_grad else None
        self.figures.add_stats(stats)
        self.figures.add("entropy", entropy.sum(), mask.sum())
        if slope is None:
            return loss_sum.detach(), count
        surrogate, _ = tp_linear_cross_entropy(hidden, weight, labels, -slope.to(mask.dtype))
        return loss_sum.detach() + (surrogate - surrogate.detach()), count

    def _mismatch(self, logps: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """Log how far the trainer's log-probabilities of the rollouts' weights (`old_logps`,
        else this pass's: the same weights with one iteration) are from the engine's that
        sampled them; the correction's importance ratios when it is on (`correction`)."""
        engine = batch.get("engine_logps")
        if engine is None:
            return None
        trainer, mask = batch.get("old_logps", logps), batch["loss_mask"]
        if self.ahead is not None:  # old_logps are the engine's: this pass's weights instead
            trainer = logps
        ratio = importance_ratio(trainer, engine, mask, self.correction) if self.correct else None
        means, extremes = mismatch_figures(trainer, engine, mask, ratio)
        self.figures.add_stats(means)
        for name, value in extremes.items():
            (self.figures.add_min if name.endswith("/min") else self.figures.add_max)(name, value)
        return ratio

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Inside the block: one greedy completion per prompt, figures kept apart."""
        held, self.figures = self.figures, RunningFigures()
        self._evaluating = True
        try:
            yield
        finally:
            self._evaluating = False
            self.figures = held

    def metrics(self) -> dict[str, float]:
        """Means since the last call over every rank holding other prompts; rollout speed and
        its share of the wall time since the last call; logged completions."""
        now = time.perf_counter()
        figures = self.figures.take(self.layout.batch_group)
        seconds = figures.pop("rollout_seconds_sum", 0.0)
        if not self._evaluating and seconds:
            figures["rollout_share"] = seconds / max(now - self._window_start, 1e-9)
        self._window_start = now
        for text in self._examples:
            log.info("%s", text)
        self._examples = []
        return figures

    # ---- rollouts into rows -----------------------------------------------------------------

    def _rollout_rows(self, micro_batches: Sequence[Batch], runner: Any) -> list[Batch]:
        """Generate, score and lay out this rank's completions, one dict per micro-batch."""
        dataset = self.run.datasets[1 if self._evaluating else 0]
        group = 1 if self._evaluating else self.section.num_generations
        prompts, samples = _prompts(micro_batches)
        params = self._params(samples, group)
        records = [dataset.records[int(i)] for b in micro_batches for i in b["prompt_index"]]
        rows_records = [r for r in records for _ in range(group)]
        if self.ahead is not None and not self._evaluating:
            outs = self._generated_ahead(prompts, samples, params)
            rewards, per_func = self._rewards(outs, rows_records)
        elif self.agent is None:
            self._refresh_rollout()
            outs = generate_split(self.rollout, prompts, params, self.layout.tensor_group)
            rewards, per_func = self._rewards(outs, rows_records)
        else:
            self._refresh_rollout()
            outs, extra = self._agent_rollouts(prompts, params, rows_records)
            rewards, per_func = self._rewards(outs, rows_records, extra)
        advantages, zero_std = self._advantages(rewards, group)
        rows = rollout_rows(outs, self.cfg.data.seq_length, self.run.device)
        rows["advantages"] = advantages.to(self.run.device, torch.float32)
        self._mask_out(rows, outs, zero_std)
        self._count_rollouts(outs, rewards, per_func, zero_std)
        per_batch = len(prompts) // len(micro_batches) * group
        split = [
            {key: value[i : i + per_batch] for key, value in rows.items()}
            for i in range(0, len(outs.completions), per_batch)
        ]
        for batch in split:
            self._add_logps(batch, runner)
        return split

    def _generated_ahead(self, prompts: list[list[int]], samples: list[int], params) -> Any:
        """This step's rollouts, generated during the step before when they were (`ahead`), else
        now; then the next step's started from the current weights."""
        iteration, group = self.run.iteration, self.layout.tensor_group
        outs, version, dropped = self.ahead.take(tuple(samples), iteration)
        if outs is None:
            self._refresh_rollout()
            outs = generate_split(self.rollout, prompts, params, group)
        self.figures.add("async/staleness", iteration - version, 1)
        self.figures.add("async/stale_dropped", dropped, 1)
        following = self._following(samples)
        if following is not None:
            self._refresh_rollout()  # the weights the next batch is generated from
            prompts_next, samples_next = following
            params_next = self._params(samples_next, self.section.num_generations)
            self.ahead.launch(
                tuple(samples_next),
                iteration,
                lambda: generate_split(self.rollout, prompts_next, params_next, None),
            )
        return outs

    def _following(self, samples: list[int]) -> tuple[list[list[int]], list[int]] | None:
        """The prompts and samples of this rank's share of the next global batch: each sample
        one global batch on (None past the end of the data)."""
        dataset, step = self.run.datasets[0], self.cfg.training.global_batch_size
        following = [s + step for s in samples]
        if max(following) >= len(dataset):
            return None
        items = [dataset[s] for s in following]
        prompts = [item["prompt"][: int(item["prompt_length"])].tolist() for item in items]
        return prompts, following

    def _refresh_rollout(self) -> None:
        """Give the rollouts the policy's weights when an optimizer step may have changed them
        since the last refresh (the iteration moved): not again for each evaluation batch,
        nor for the training step that follows an evaluation at the same iteration. A batch
        being generated ahead is waited for first (it keeps the weights it began with)."""
        if self._refreshed_at != self.run.iteration:
            if self.ahead is not None:
                self.ahead.drain()
            self.rollout.refresh()
            self._refreshed_at = self.run.iteration

    def _params(self, samples: Sequence[int], group: int) -> list[list[Any]]:
        """Each completion's sampling parameters: its own seed (`completion_seed`); greedy in
        evaluation."""
        from pipeline.serve.engine.sampling import SamplingParams

        s = self.section
        if self._evaluating:
            params = SamplingParams(
                s.max_completion_length, greedy=True, stop_token_ids=self.stop_ids
            )
            return [[params] for _ in samples]
        seed = self.cfg.training.seed
        return [
            [
                SamplingParams(
                    s.max_completion_length,
                    s.temperature,
                    s.top_k,
                    s.top_p,
                    seed=completion_seed(seed, sample, g),
                    stop_token_ids=self.stop_ids,
                    logprobs=0,  # the engine's own, for the mismatch and its correction
                )
                for g in range(group)
            ]
            for sample in samples
        ]

    def _agent_rollouts(
        self, prompts: list[list[int]], params: list[list[Any]], records: list[Any]
    ) -> tuple[Any, Any]:
        """Multi-turn rollouts with tools, one environment instance each (reset on its prompt's
        line; text it returns appended to the user turn). (Rollouts, AgentRollouts)."""
        from pipeline.train.objectives.grpo.tools import ToolBox

        flat = [p for group in params for p in group]
        starts = [p for p, group in zip(prompts, params) for _ in group]
        boxes = []
        for index, record in enumerate(records):
            environment = None
            if self.environment is not None:
                while len(self._environments) <= index:
                    self._environments.append(self.environment())
                environment = self._environments[index]
                seen = environment.reset(prompt=record.prompt, **record.fields)
                if seen is not None:
                    starts[index] = self._observed(record, str(seen))
            boxes.append(ToolBox(self.tools, environment))
        group = self.layout.tensor_group

        def generate(turn_prompts, turn_params):
            return generate_split(self.rollout, turn_prompts, turn_params, group)

        extra = self.agent.run(generate, starts, flat, boxes)
        extra.environments = [box.environment for box in boxes] if self.environment else None
        return extra.rollouts, extra

    def _observed(self, record: Any, seen: str) -> list[int]:
        """The prompt's tokens with an environment's `reset` text appended to its last turn."""
        from pipeline.data.prompt_files import prompt_messages

        messages = prompt_messages(record.prompt)
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + seen}
        tokens = self.text.encode_batch([self._render(messages)])[0]
        room = self.cfg.data.seq_length - self.section.max_completion_length
        if len(tokens) > room:
            raise ConfigError(
                f"{record.source}: with the environment's reset text the prompt is "
                f"{len(tokens)} tokens, over the {room} that data.seq_length - "
                "grpo.max_completion_length leaves"
            )
        return list(tokens)

    def _rewards(
        self, outs: Any, records: list[Any], extra: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weighted reward `[rows]`, each function's `[rows, F]`) of the completions; with tools
        (`extra`, the agent's rollouts) the built-in rewards read each one's last turn."""
        from pipeline.train.objectives.grpo.rewards import RewardError

        if extra is None:
            texts = [self.text.decode(_without_stop(c, self.stop_ids)) for c in outs.completions]
            scoring = (records, texts, outs.completions)
        else:
            texts = extra.texts
            scoring = (records, texts, outs.completions, extra.messages, extra.environments)
            self._count_tools(extra)
        try:
            per_func = torch.as_tensor(self.rewards.score(*scoring))
        except RewardError as e:  # the user's function: one line naming it and the prompt
            raise ConfigError(str(e)) from None
        weights = torch.as_tensor(self.rewards.weights, dtype=per_func.dtype)
        rewards = weighted_rewards(per_func, weights)
        if self.section.log_completions and not self._evaluating:
            self._keep_examples(records, texts, rewards)
        return rewards, per_func

    def _advantages(self, rewards: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Group-relative advantages, and whether each row's group has rewards all equal; with
        scale_rewards = "batch" the standard deviation is the global batch's, over every rank
        holding other prompts (TRL's nanstd, as one sum of squares)."""
        scale = self.section.scale_rewards
        per_group = "group" if scale == "batch" else scale
        advantages, zero_std = group_advantages(rewards, group, per_group)
        if scale == "batch":  # the flags stay the groups' (for mask_zero_std_groups)
            advantages, _ = group_advantages(rewards, group, "none")
            advantages = advantages / (_global_std(rewards, self.layout.batch_group) + 1e-4)
        return advantages, zero_std

    def _mask_out(self, rows: Batch, outs: Any, zero_std: torch.Tensor) -> None:
        """Truncated completions and equal-reward groups out of the loss where asked."""
        keep = torch.ones(len(outs.completions), dtype=torch.bool)
        if self.section.mask_truncated_completions:
            keep &= ~torch.tensor(outs.truncated, dtype=torch.bool)
        if self.section.mask_zero_std_groups:
            keep &= ~zero_std.cpu()
        rows["loss_mask"] = rows["loss_mask"] * keep.to(rows["loss_mask"])[:, None]

    def _add_logps(self, batch: Batch, runner: Any) -> None:
        """The sampling weights' log-probabilities (kept for later passes) and the reference's."""
        with torch.no_grad():
            if self.ahead is not None and not self._evaluating:
                batch["old_logps"] = batch["engine_logps"]  # the weights that sampled them
            elif self.section.num_iterations > 1 and not self._evaluating:
                batch["old_logps"] = _token_logps(runner, batch)
            if self.reference is not None:
                batch["ref_logps"] = _token_logps(self.reference, batch)

    # ---- figures ----------------------------------------------------------------------------

    def _count_rollouts(self, outs, rewards, per_func, zero_std) -> None:
        f, rows = self.figures, len(outs.completions)
        # the model's own tokens (as TRL counts them): not a tool message's
        own = outs.tool_masks or outs.completions
        lengths = torch.tensor(
            [sum(m) if outs.tool_masks else len(m) for m in own], dtype=torch.float64
        )
        f.add_spread("reward", rewards)
        for name, column in zip(self.rewards.names, per_func.T):
            name = name.rsplit(":", 1)[-1]  # a user's function by its own name, as TRL logs it
            f.add_spread(f"rewards/{name}", column)
            if name == "accuracy":
                f.add("accuracy", column.nansum(), (~column.isnan()).sum())
        f.add("completions/mean_length", lengths.sum(), rows)
        f.add_max("completions/max_length", lengths.max())
        f.add("completions/clipped_ratio", float(sum(outs.truncated)), rows)
        f.add("frac_reward_zero_std", zero_std.double().sum(), rows)
        if not self._evaluating:
            f.add("rollout_tokens_per_s", outs.generated_tokens, outs.seconds)
            f.add("rollout_seconds_sum", outs.seconds, 1)
            f.add("prompt_tokens_computed", outs.prompt_tokens_computed, 1)
            f.add("prompt_tokens_cached", outs.prompt_tokens_cached, 1)

    def _count_tools(self, extra: Any) -> None:
        """TRL's `tools/call_frequency` (calls per completion) and `tools/failure_frequency`
        (of the calls), and `tools/used`: the share of completions that called a tool."""
        f, rows, calls = self.figures, len(extra.calls), sum(extra.calls)
        f.add("tools/call_frequency", calls, rows)
        f.add("tools/used", sum(1 for c in extra.calls if c), rows)
        f.add("tools/failure_frequency", sum(extra.failures), calls)

    def _keep_examples(self, records: list[Any], texts: list[str], rewards: torch.Tensor) -> None:
        if self.layout.rank != 0:
            return
        self._examples = [
            f"completion of {record.source} (reward {float(reward):.3f}): {text!r}"
            for record, text, reward in list(zip(records, texts, rewards))[
                : self.section.num_completions_to_print
            ]
        ]


def _prompts(micro_batches: Sequence[Batch]) -> tuple[list[list[int]], list[int]]:
    """The prompts' tokens (padding cut) and global sample indices of every micro-batch."""
    prompts, samples = [], []
    for batch in micro_batches:
        for tokens, length, sample in zip(
            batch["prompt"], batch["prompt_length"], batch["sample_index"]
        ):
            prompts.append(tokens[: int(length)].tolist())
            samples.append(int(sample))
    return prompts, samples


def _without_stop(completion: list[int], stop_ids: frozenset[int]) -> list[int]:
    return completion[:-1] if completion and completion[-1] in stop_ids else completion


def _token_logps(runner: Any, batch: Batch) -> torch.Tensor:
    """Each token's log-probability `[rows, seq]` (0 off the mask) by `runner`'s model."""
    module, hidden = runner.hidden_states(batch)
    logps, _ = token_logprobs(hidden, module.output.weight, batch["labels"])
    return logps.view_as(batch["loss_mask"]) * batch["loss_mask"]


def _global_std(values: torch.Tensor, group: Any) -> torch.Tensor:
    """The unbiased standard deviation of `values` over every rank of `group` (NaN left out)."""
    from pipeline.core.parallel.reduce import sum_over_groups

    if group is None:
        return nanstd(values)
    seen = ~values.isnan()
    v = values[seen].double()
    sums = sum_over_groups(torch.stack([v.sum(), (v * v).sum(), seen.sum().double()]), [group])
    total, squares, n = sums.tolist()
    variance = (squares - total * total / n) / (n - 1) if n > 1 else 0.0
    return torch.tensor(max(variance, 0.0) ** 0.5, dtype=values.dtype)
