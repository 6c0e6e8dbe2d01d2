"""Tokenizers behind one small interface: the project's character tokenizer (toy builtins) and HF tokenizers.

One token per character of printable ASCII plus newline, behind four special tokens. The synthetic
arithmetic task only uses a couple of dozen of these characters, but real datasets loaded from JSONL
(GSM8K-style word problems) need letters and punctuation too; anything else maps to `<unk>`.
The vocabulary is fixed by construction, so two processes always agree on ids without sharing a file.

`CharTokenizer` is the source of truth used by the runtime. `save_pretrained` additionally writes a
`tokenizer.json` (Hugging Face `tokenizers` format: WordLevel over single characters) so a checkpoint
folder can be loaded by `transformers.AutoTokenizer` or vLLM with no custom code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
# Printable ASCII (space .. tilde) and newline, in a fixed order.
CHARACTERS: tuple[str, ...] = tuple(chr(c) for c in range(32, 127)) + ("\n",)

TOKENIZER_CONFIG = "specrl_tokenizer.json"


class CharTokenizer:
    """Character-level tokenizer: `encode(str) -> list[int]`, `decode(list[int]) -> str`."""

    pad_id = 0
    bos_id = 1
    eos_id = 2
    unk_id = 3

    def __init__(self) -> None:
        self.id_to_token: tuple[str, ...] = SPECIAL_TOKENS + CHARACTERS
        self.token_to_id: dict[str, int] = {tok: i for i, tok in enumerate(self.id_to_token)}

    @property
    def vocab_size(self) -> int:
        return len(self.id_to_token)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(range(len(SPECIAL_TOKENS)))

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        get = self.token_to_id.get
        ids = [get(ch, self.unk_id) for ch in text]
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`; decoding stops at nothing — callers cut at EOS themselves when they want to."""
        out: list[str] = []
        n = self.vocab_size
        for i in ids:
            i = int(i)
            if not 0 <= i < n:
                raise ValueError(f"token id {i} is outside the vocabulary (size {n})")
            if skip_special and i < len(SPECIAL_TOKENS):
                continue
            out.append(self.id_to_token[i])
        return "".join(out)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    def prompt_ids(self, text: str) -> list[int]:
        """What a toy policy is conditioned on: BOS + prompt text (the response follows directly)."""
        return self.encode(text, add_bos=True)

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special: bool = True) -> list[str]:
        return [self.decode(ids, skip_special) for ids in batch]

    # -- files ---------------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> list[Path]:
        """Write the tokenizer files of a Hugging Face checkpoint folder; returns the paths written."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        spec = {"type": "specrl-char", "version": 1, "tokens": list(self.id_to_token)}
        path = directory / TOKENIZER_CONFIG
        path.write_text(json.dumps(spec, indent=1) + "\n")
        written.append(path)
        path = directory / "tokenizer.json"
        path.write_text(json.dumps(self._hf_tokenizer_json()) + "\n")
        written.append(path)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "unk_token": UNK,
            "model_max_length": 4096,
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        path = directory / "tokenizer_config.json"
        path.write_text(json.dumps(config, indent=1) + "\n")
        written.append(path)
        path = directory / "special_tokens_map.json"
        path.write_text(json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}) + "\n")
        written.append(path)
        return written

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> CharTokenizer:
        """Load from a checkpoint folder, refusing one written by a different vocabulary."""
        path = Path(directory) / TOKENIZER_CONFIG
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no specrl tokenizer in this model folder")
        spec = json.loads(path.read_text())
        tok = cls()
        if spec.get("type") != "specrl-char" or tuple(spec.get("tokens", ())) != tok.id_to_token:
            raise ValueError(f"{path}: tokenizer vocabulary differs from this version of specrl's CharTokenizer")
        return tok

    def _hf_tokenizer_json(self) -> dict:
        """`tokenizers` JSON: split into single characters, WordLevel lookup, decoder fuses without spaces."""
        vocab = {tok: i for i, tok in enumerate(self.id_to_token)}
        added = [
            {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, tok in enumerate(SPECIAL_TOKENS)
        ]
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated",
                              "invert": False},
            "post_processor": None,
            "decoder": {"type": "Fuse"},
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": UNK},
        }


class HFTokenizer:
    """A Hugging Face tokenizer behind the same small interface as `CharTokenizer`, plus prompt building.

    `eos_id` is the generation config's EOS (SmolLM2: `<|im_end|>`, which ends an assistant turn), not
    necessarily the tokenizer's `eos_token`; `stop_ids` holds every EOS the generation config lists.
    `prompt_ids(text)` applies the chat template (with the optional system prompt) when the tokenizer has
    one and `chat` is on, else BOS (when the model uses one) + raw text.
    """

    def __init__(self, hf: Any, *, eos_ids: list[int] | None = None, chat: bool = True,
                 system_prompt: str | None = None) -> None:
        self.hf = hf
        eos = [int(i) for i in (eos_ids or [])] or ([int(hf.eos_token_id)] if hf.eos_token_id is not None else [])
        if not eos:
            raise ValueError("tokenizer: no EOS token in the tokenizer or the generation config")
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.eos_id = self.stop_ids[0]
        self.bos_id = int(hf.bos_token_id) if hf.bos_token_id is not None else None
        self.pad_id = int(hf.pad_token_id) if hf.pad_token_id is not None else self.eos_id
        self.unk_id = int(hf.unk_token_id) if hf.unk_token_id is not None else None
        self.chat = chat and bool(getattr(hf, "chat_template", None))
        self.system_prompt = system_prompt

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(int(i) for i in self.hf.all_special_ids)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(self.hf.encode(text, add_special_tokens=False))
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        ids = [int(i) for i in ids]
        n = self.vocab_size
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"token id {i} is outside the vocabulary (size {n})")
        return self.hf.decode(ids, skip_special_tokens=skip_special)

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special: bool = True) -> list[str]:
        return [self.decode(ids, skip_special) for ids in batch]

    def prompt_text(self, text: str) -> str:
        """The prompt as the model sees it, before tokenisation (chat template applied when on)."""
        if not self.chat:
            return text
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + \
            [{"role": "user", "content": text}]
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompt_ids(self, text: str) -> list[int]:
        if self.chat:  # the template writes its own special tokens
            return self.encode(self.prompt_text(text))
        return self.encode(text, add_bos=bool(getattr(self.hf, "add_bos_token", False)))

    def save_pretrained(self, directory: str | Path) -> list[Path]:
        return [Path(p) for p in self.hf.save_pretrained(str(directory))]
