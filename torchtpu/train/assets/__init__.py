"""Bundled training data: corpus.txt, tokenizer.json and the script that makes them (make_assets.py)."""
