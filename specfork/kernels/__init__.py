"""Attention kernels over the paged KV tree (Triton on GPU, torch on CPU)."""
