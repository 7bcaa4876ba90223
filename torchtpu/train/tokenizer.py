"""Tokenizers for the trainer: the bundled BPE, a Hugging Face tokenizer.json, or a tiktoken model.

tok = build_tokenizer(None)                       # bundled (torchtpu/train/assets/tokenizer.json)
tok = build_tokenizer("assets/hf/Llama-3.1-8B")   # a folder holding tokenizer.json or tokenizer.model
ids = tok.encode("Hello", bos=True, eos=True)
tok.decode(ids), tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id
tok.export_files("outputs/hf_step_40")           # the files transformers and vLLM load it from
"""

from __future__ import annotations

import json
import os
import shutil

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
BUNDLED_TOKENIZER = os.path.join(ASSETS_DIR, "tokenizer.json")

# Names that mark the beginning / end of a document in common tokenizers, most specific first.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|im_start|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>", "<|eot_id|>", "<|im_end|>")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")
# Files of a Hugging Face tokenizer besides tokenizer.json / tokenizer.model, copied as they are.
_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")

# Llama 3's pre-tokenization regex (from its published tokenizer configuration).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL = 256


class Tokenizer:
    """Common interface: encode/decode, vocab_size, bos_id, eos_id, pad_id, and where it came from.

    pad_id is the tokenizer's own padding token, or eos_id when it has none (nothing in training
    pads; a Hugging Face export names it for the tools that do)."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    source: str

    def _encode_plain(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = self._encode_plain(text)
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids) -> str:
        raise NotImplementedError

    def export_files(self, folder: str) -> list[str]:
        """Write the files transformers and vLLM load this tokenizer from into `folder` (a
        Hugging Face model folder); returns their names."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, source={self.source!r})"


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer.json. Its own post-processor (which may add BOS) is
    bypassed; BOS/EOS are added by `encode` only when asked."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _HF

        self.source = path
        self._tok = _HF.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config = _read_tokenizer_config(os.path.dirname(path))
        self.bos_id = self._special_id(config.get("bos_token"), _BOS_NAMES)
        self.eos_id = self._special_id(config.get("eos_token"), _EOS_NAMES)
        if self.bos_id is None and self.eos_id is None:
            raise ValueError(
                f"{path}: found no beginning/end-of-text special token (looked for "
                f"{', '.join(_BOS_NAMES + _EOS_NAMES)}); add one to the tokenizer or use another tokenizer"
            )
        # Tokenizers with a single document separator (GPT-2 style) use it for both ends.
        if self.bos_id is None:
            self.bos_id = self.eos_id
        if self.eos_id is None:
            self.eos_id = self.bos_id
        pad = self._special_id(config.get("pad_token"), _PAD_NAMES)
        self.pad_id = self.eos_id if pad is None else pad

    def _special_id(self, configured, names):
        if isinstance(configured, dict):
            configured = configured.get("content")
        for name in ([configured] if configured else []) + list(names):
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return tid
        return None

    def _encode_plain(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def export_files(self, folder: str) -> list[str]:
        """tokenizer.json, and the tokenizer's own tokenizer_config.json and side files when it has
        them, else a tokenizer_config.json naming its BOS/EOS/pad tokens.

        torchtpu-train starts every document with BOS. A tokenizer.json with no post-processor
        (the bundled one) would let transformers and vLLM encode a prompt without it, so the
        exported copy gets one that prepends BOS, as Llama 3's own tokenizer.json has."""
        with open(self.source, encoding="utf-8") as f:
            spec = json.load(f)
        if spec.get("post_processor") is None:
            spec["post_processor"] = _prepend_template(self._tok.id_to_token(self.bos_id), self.bos_id)
        with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(spec, f, ensure_ascii=False)
        written = ["tokenizer.json"] + _copy_side_files(os.path.dirname(self.source), folder)
        if "tokenizer_config.json" not in written:
            config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": self._tok.id_to_token(self.bos_id),
                "eos_token": self._tok.id_to_token(self.eos_id),
                "pad_token": self._tok.id_to_token(self.pad_id),
                "clean_up_tokenization_spaces": False,
            }
            with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2)
            written.append("tokenizer_config.json")
        return sorted(written)


class TiktokenTokenizer(Tokenizer):
    """A Llama-3-style tiktoken BPE ranks file (`tokenizer.model`): the ranks, Llama 3's split
    pattern, then 256 special tokens numbered after the ranks, the first two being
    <|begin_of_text|> and <|end_of_text|>."""

    def __init__(self, path: str):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        self.source = path
        ranks = load_tiktoken_bpe(path)
        n = len(ranks)
        named = [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|reserved_special_token_0|>",
            "<|reserved_special_token_1|>",
            "<|finetune_right_pad_id|>",
            "<|reserved_special_token_2|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
            "<|eot_id|>",
            "<|python_tag|>",
        ]
        specials = named + [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + LLAMA3_NUM_SPECIAL - len(named))]
        self._special = {tok: n + i for i, tok in enumerate(specials)}
        self._enc = tiktoken.Encoding(
            name=os.path.basename(path), pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=self._special
        )
        self.vocab_size = n + len(specials)
        self.bos_id = self._special["<|begin_of_text|>"]
        self.eos_id = self._special["<|end_of_text|>"]
        self.pad_id = self._special["<|finetune_right_pad_id|>"]

    def _encode_plain(self, text: str) -> list[int]:
        # Special-token text inside a document is encoded as ordinary text, never as a control token.
        return self._enc.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])

    def export_files(self, folder: str) -> list[str]:
        """tokenizer.model and the side files beside it (tokenizer_config.json, ...). transformers
        reads a tiktoken ranks file only through a tokenizer.json converted from it, so for tools
        that need one, point hf_assets_path at the model's Hugging Face tokenizer.json instead."""
        shutil.copyfile(self.source, os.path.join(folder, "tokenizer.model"))
        return sorted(["tokenizer.model"] + _copy_side_files(os.path.dirname(self.source), folder))


def _prepend_template(bos: str, bos_id: int) -> dict:
    """A `tokenizers` TemplateProcessing post-processor that starts each sequence with `bos`."""
    token = {"SpecialToken": {"id": bos, "type_id": 0}}
    return {
        "type": "TemplateProcessing",
        "single": [token, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [token, {"Sequence": {"id": "A", "type_id": 0}}, token, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }


def _copy_side_files(src: str, folder: str) -> list[str]:
    """Copy the tokenizer side files present in `src` (never from torchtpu's bundled assets,
    which have none) into `folder`; their names."""
    if os.path.abspath(src) == ASSETS_DIR:
        return []
    names = [n for n in _SIDE_FILES if os.path.isfile(os.path.join(src, n))]
    for n in names:
        shutil.copyfile(os.path.join(src, n), os.path.join(folder, n))
    return names


def _read_tokenizer_config(folder: str) -> dict:
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def resolve_tokenizer_file(hf_assets_path: str | None) -> str:
    """The tokenizer file a path names: the bundled one for ''/None, the file itself, or inside a
    folder tokenizer.json, then tokenizer.model, then original/tokenizer.model."""
    if not hf_assets_path:
        return BUNDLED_TOKENIZER
    path = os.path.abspath(os.path.expanduser(hf_assets_path))
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        for name in ("tokenizer.json", "tokenizer.model", os.path.join("original", "tokenizer.model")):
            candidate = os.path.join(path, name)
            if os.path.isfile(candidate):
                return candidate
        raise FileNotFoundError(
            f"no tokenizer in {path}: expected tokenizer.json (Hugging Face tokenizers) or tokenizer.model "
            f"(tiktoken BPE ranks). Download the model's tokenizer files into that folder, or leave "
            f"model.hf_assets_path empty to use torchtpu's bundled tokenizer."
        )
    raise FileNotFoundError(
        f"tokenizer path {path} does not exist. Point model.hf_assets_path at a folder (or file) holding "
        f"tokenizer.json or tokenizer.model, or leave it empty to use torchtpu's bundled tokenizer."
    )


def build_tokenizer(hf_assets_path: str | None) -> Tokenizer:
    """Load a tokenizer: bundled when `hf_assets_path` is empty/None, else from that file or folder.

    A `.json` file is read with Hugging Face `tokenizers`; anything else (tokenizer.model) as a
    tiktoken BPE ranks file with Llama 3's pattern and special tokens.
    """
    path = resolve_tokenizer_file(hf_assets_path)
    if path.endswith(".json"):
        return HFTokenizer(path)
    try:
        return TiktokenTokenizer(path)
    except Exception as exc:  # not a ranks file: say what was expected
        raise ValueError(
            f"{path} is neither a Hugging Face tokenizer.json nor a tiktoken BPE ranks file "
            f"(lines of '<base64 token> <rank>'): {exc}"
        ) from exc
