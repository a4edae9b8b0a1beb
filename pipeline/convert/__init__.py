"""`pipe convert`: checkpoints to and from Hugging Face, between parallel layouts, and from
Megatron, streamed a few tensors at a time. The command, its run and the bit-for-bit check live
here; the readers and writers it runs are `pipeline.weights`."""
