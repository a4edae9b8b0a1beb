"""Generation and serving: a block KV cache and cached decoding over the training model's own
weights (`decode`, `kv_cache`), sampling, the continuous-batching engine, and the `pipe generate`
and `pipe serve` commands (an OpenAI-compatible HTTP server)."""
