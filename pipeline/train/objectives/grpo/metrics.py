"""Running figures of an objective between two log steps: sums and counts kept per name, added
over the ranks holding other data when read, so a logged mean is the global batch's whatever
the layout. Means (`add`), a mean with its standard deviation (`add_spread`), maxima
(`add_max`) and minima (`add_min`)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RunningFigures"]


def _number(value: Any) -> float:
    return float(value.detach().double()) if isinstance(value, torch.Tensor) else float(value)


class RunningFigures:
    """Named sums over counts and maxima, read and reset by `take` (every rank calls it)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._sums: dict[str, list[float]] = {}  # name -> [sum, count]
        self._spreads: dict[str, list[float]] = {}  # name -> [sum, sum of squares, count]
        self._maxima: dict[str, float] = {}

    def add(self, name: str, total: Any, count: Any) -> None:
        """`total` over `count` more items of figure `name` (its mean is logged)."""
        entry = self._sums.setdefault(name, [0.0, 0.0])
        entry[0] += _number(total)
        entry[1] += _number(count)

    def add_stats(self, stats: dict[str, tuple[Any, Any]]) -> None:
        """Several figures at once: name -> (sum, count)."""
        for name, (total, count) in stats.items():
            self.add(name, total, count)

    def add_spread(self, name: str, values: torch.Tensor) -> None:
        """`values` (NaN left out) of a figure logged as `name/mean` and `name/std`."""
        seen = values[~values.isnan()].double()
        entry = self._spreads.setdefault(name, [0.0, 0.0, 0.0])
        entry[0] += float(seen.sum())
        entry[1] += float((seen * seen).sum())
        entry[2] += seen.numel()

    def add_max(self, name: str, value: Any) -> None:
        self._maxima[name] = max(self._maxima.get(name, float("-inf")), _number(value))

    def add_min(self, name: str, value: Any) -> None:
        """The least value of figure `name`, which must end in `/min` (kept as the maximum of
        its negation, so every rank knows by the name alone to negate it back)."""
        if not name.endswith("/min"):
            raise ValueError(f"a minimum's name ends in /min: {name!r}")
        self.add_max(name, -_number(value))

    def take(self, group: Any = None) -> dict[str, float]:
        """The figures since the last call over every rank of `group`, then reset."""
        from pipeline.core.parallel.reduce import sum_over_groups

        sums, spreads, maxima = self._agree_on_names(group)
        flat = [v for n in sums for v in self._sums.get(n, [0.0, 0.0])]
        flat += [v for n in spreads for v in self._spreads.get(n, [0.0, 0.0, 0.0])]
        totals = sum_over_groups(torch.tensor(flat, dtype=torch.float64), [group]).tolist()
        out: dict[str, float] = {}
        for i, name in enumerate(sums):
            total, count = totals[2 * i : 2 * i + 2]
            if count:
                out[name] = total / count
        offset = 2 * len(sums)
        for i, name in enumerate(spreads):
            total, squares, n = totals[offset + 3 * i : offset + 3 * i + 3]
            if n:
                out[f"{name}/mean"] = total / n
                variance = (squares - total * total / n) / (n - 1) if n > 1 else 0.0
                out[f"{name}/std"] = max(variance, 0.0) ** 0.5
        extremes = self._max_over(maxima, group)
        out |= {n: -v if n.endswith("/min") else v for n, v in extremes.items()}
        self._reset()
        return out

    def _agree_on_names(self, group: Any) -> tuple[list[str], list[str], list[str]]:
        """The names every rank of `group` has seen (a rank may have seen fewer), sorted."""
        names = [sorted(self._sums), sorted(self._spreads), sorted(self._maxima)]
        if group is None:
            return names[0], names[1], names[2]
        import torch.distributed as dist

        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, names, group=group)
        return tuple(sorted(set().union(*(seen[k] for seen in everyone))) for k in range(3))

    def _max_over(self, names: list[str], group: Any) -> dict[str, float]:
        if not names:
            return {}
        values = torch.tensor([self._maxima.get(n, float("-inf")) for n in names])
        if group is not None:
            import torch.distributed as dist

            if dist.get_backend(group) == "nccl":
                values = values.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
        return dict(zip(names, values.cpu().tolist()))
