"""Checkpoints: Orbax saves and loads (manager), the folder layout (files), the manifest of a
training state (manifest), Hugging Face safetensors (hf) and where a run starts (resume)."""
