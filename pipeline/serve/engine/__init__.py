"""The serving engine: continuous batching over a paged KV cache with a prefix cache, sampling,
decoding through the training model's own modules, adapter slots and weight updates, and the engine
process with the typed messages it exchanges. Nothing here imports `pipeline.serve.http`; training's
rollouts use this room directly."""
