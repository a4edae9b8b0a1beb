"""The legacy TensorRT-LLM target (`pipe export --trtllm --trtllm-format legacy`): the rank files
`trtllm-build` reads in TensorRT-LLM releases up to 1.3. Frozen: kept working, not extended.

`config.py` writes and reads its `config.json` and holds `LegacyExportOptions` (the export
options plus the rank mapping), `layout.py` cuts tensors over ranks and back, `writer.py` streams
the rank files, `reference.py` is a plain-torch forward over the written files and `verify.py`
compares it with our model on the source.
"""
