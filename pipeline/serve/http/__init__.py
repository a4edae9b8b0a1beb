"""The OpenAI-compatible HTTP side of `pipe serve`: request bodies and responses, routes, jobs,
tool-call and structured-output handling, adapter and weight routes, and the client that talks to
the engine process (`pipeline.serve.engine`)."""
