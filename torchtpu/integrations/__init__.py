"""What foreign training code needs of the tpu device beyond PyTorch's own contract: small, named
replacements for the CUDA-only pieces of libraries that users run unchanged (torchtitan.py: its
trainer; dcp.py: PyTorch's distributed checkpoint), each applied when its module is imported
(on_import.py)."""
