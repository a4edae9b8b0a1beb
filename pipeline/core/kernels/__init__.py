"""Interchangeable compute kernels. The torch implementations here are the reference numerics;
faster backends (flash-attn, Transformer Engine, fused cross-entropy) plug in behind the same
functions and are tested against them.
"""
