"""pipe: a toolkit for the whole life of an LLM pre-training run."""

__version__ = "0.1.0"
