"""One transformer definition (`transformer.py`, its block's pieces in `block.py`, shared with
the multi-token prediction modules of `mtp.py`; `moe.py`, `rope.py`; `kv_seam.py`: how a KV
cache feeds its attention; `kv_sizes.py`: what it holds per token; `greedy.py`: greedy
decoding) and its configurations (`config.py`, named sizes in `flavors.py`). Import the
submodules directly; this package file stays empty so that reading a config does not import
torch."""
