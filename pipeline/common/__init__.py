"""The shared layer under every package: atomic writes, hashing, progress bars, quiet library
imports and safetensors encoding. It imports no other pipe package, and its modules import
nothing heavy at import time except `safetensors_io` (torch)."""
