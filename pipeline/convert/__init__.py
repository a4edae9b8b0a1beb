"""`pipe convert`: checkpoints to and from Hugging Face, between parallel layouts, and from
Megatron, streamed a few tensors at a time."""
