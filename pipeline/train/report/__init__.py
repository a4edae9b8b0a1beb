"""What a run reports: metrics to the console, JSONL, TensorBoard and W&B (`metrics.py`), device
peak FLOP/s and memory (`perf.py`), sizes and memory for `--dry-run` (`estimates.py`), `pipe plot`
(`plot.py`) and the greedy samples logged during training (`samples.py`)."""
