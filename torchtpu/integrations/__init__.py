"""What foreign training code needs of the tpu device beyond PyTorch's own contract: small, named
replacements for the CUDA-only pieces of libraries that users run unchanged (torchtitan.py)."""
