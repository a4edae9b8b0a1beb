"""`pipe export`: checkpoints to inference formats (TensorRT-LLM checkpoints)."""
