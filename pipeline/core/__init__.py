"""The parallel FP8 core: model, kernels, parallelism."""
