"""`pipe export`: checkpoints to serving formats. The Hugging Face checkpoint TensorRT-LLM, vLLM
and SGLang load (`options.py`, `hf_export.py`; FP8 in ModelOpt's or DeepSeek's block format) and
the frozen legacy TensorRT-LLM rank files (`legacy_trtllm/`); `run.py` dispatches on the target."""
