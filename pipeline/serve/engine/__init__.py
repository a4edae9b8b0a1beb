"""The serving engine: continuous batching over a paged KV cache with a prefix cache, sampling,
decoding through the training model's own modules, adapter slots and weight updates, and the engine
process with the typed messages it exchanges. `core.Engine` takes requests and runs steps; its
parts each have a module: `request_checks` (what is refused at the door), `scheduler` (the queue,
admission to the batch, each step's rows), `prefix_cache` (the prefix cache's policy), `groups`
(completions of one prompt sharing its prefill), `request` (the request record and its events).
Nothing here imports `pipeline.serve.http`; training's rollouts use this room directly."""
