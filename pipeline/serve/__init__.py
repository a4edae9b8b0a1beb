"""Generation and serving: a block KV cache and cached decoding that runs the training model's own
modules through its KV-cache seam (`kv_cache`; `decode`: slots and masks only), sampling, the
continuous-batching engine, and the `pipe generate` and `pipe serve` commands (an
OpenAI-compatible HTTP server)."""
