"""Tokenizer metadata (tokenizer.ggml.*) from the tokenizer files beside the checkpoint, as llama.cpp's converter
writes it for the families we export:

- BPE (tokenizer.json with a byte-level BPE model): model "gpt2", the token list of `vocab_size` entries (ids with
  no token are "[PAD<id>]", UNUSED), token types (added special tokens CONTROL, other added tokens USER_DEFINED,
  the rest NORMAL), merges, and the special token ids / add_*_token flags / chat template that gguf-py's
  `SpecialVocab` reads from tokenizer.json, tokenizer_config.json and config.json (it is given a private folder
  holding only those side files, read through the engine's size-capped side-file reader).
- The pre-tokenizer name (tokenizer.ggml.pre): llama.cpp picks it by hashing the token ids of a fixed text; we
  pick it from the pre-tokenizer's split regex in tokenizer.json (`PRE_BY_REGEX`), or take `pre` when given.
- SentencePiece (a tokenizer.model, which llama.cpp prefers when present): model "llama", pre "default", the
  pieces with their scores and types (read by `spm`), added_tokens.json and tokenizer_config.json's
  added_tokens_decoder on top, then the same SpecialVocab keys.
- Byte-fallback tokenizer.json files (llama.cpp's LlamaHfVocab) are refused in one line for now; so is a source
  with neither tokenizer.json nor tokenizer.model.

Reading is JSON only: no tokenizer library is imported.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import gguf

from ..errors import FormatError, OptionError
from ..jsonsafe import loads
from . import spm

#: Split regexes of byte-level BPE pre-tokenizers -> llama.cpp's pre-tokenizer name for them.
PRE_BY_REGEX = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+": "qwen2",
}
SIDE = ("tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja", "chat_template.json",
        "added_tokens.json")
NEEDED = "tokenizer.json (a byte-level BPE tokenizer) or tokenizer.model (SentencePiece)"


def json_object(data: bytes, name: str, uri: str) -> dict[str, Any]:
    doc = loads(data, f"{uri} ({name})")
    if not isinstance(doc, dict):
        raise FormatError(f"{uri} ({name}): not a JSON object; fix the file", uri=uri, key=name)
    return doc


def _pre_name(tokenizer: dict[str, Any], uri: str) -> str:
    pre = tokenizer.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if isinstance(pre, dict) else []
    kinds = [s.get("type") for s in steps if isinstance(s, dict)]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = steps[0].get("pattern") or {}
        regex = pattern.get("Regex") if isinstance(pattern, dict) else None
        if regex in PRE_BY_REGEX:
            return PRE_BY_REGEX[regex]
    raise FormatError(f"{uri} (tokenizer.json): its pre-tokenizer is not one the GGUF export recognizes; pass "
                      "tokenizer_pre=NAME (llama.cpp's name for it, e.g. llama-bpe, qwen2)", uri=uri,
                      key="pre_tokenizer")


def _looks_special(token: str) -> bool:
    return token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>")) \
        or (token.startswith("<｜") and token.endswith("｜>")) or (token.startswith("<unused") and token.endswith(">"))


def _vocab_size(config: dict[str, Any], found: int, rows: int, uri: str) -> int:
    """config.json's vocab_size (else the tokenizer's size), which must not pass the embedding's rows."""
    size = config.get("vocab_size") or found
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= rows:
        raise FormatError(f"{uri} (config.json): vocab_size {size!r} does not fit the {rows} rows of the token "
                          "embedding; fix config.json", uri=uri, key="vocab_size")
    return size


def add_vocab(writer: gguf.GGUFWriter, side: dict[str, bytes], config: dict[str, Any], uri: str, rows: int,
              pre: str | None = None, add_space_prefix: bool = False) -> None:
    """Add the tokenizer.ggml.* keys for the tokenizer in `side` (file name -> bytes); `rows`: the token
    embedding's rows (the most tokens the list may hold)."""
    if add_space_prefix:
        cfg = json_object(side["tokenizer_config.json"], "tokenizer_config.json", uri) \
            if "tokenizer_config.json" in side else {}
        if (prefix := cfg.get("add_prefix_space")) is not None:
            writer.add_add_space_prefix(bool(prefix))
    if "tokenizer.model" in side:  # llama.cpp prefers it to tokenizer.json
        _add_spm(writer, side, config, uri, rows)
        return
    if "tokenizer.json" not in side:
        raise OptionError(f"{uri}: no tokenizer beside the checkpoint; llama.cpp needs {NEEDED}: put it in the "
                          "source folder or pass config_from=DIR", field="config_from", option="config_from")
    tokenizer = json_object(side["tokenizer.json"], "tokenizer.json", uri)
    model = tokenizer.get("model") or {}
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise FormatError(f"{uri} (tokenizer.json): not a BPE tokenizer; the GGUF export writes byte-level BPE "
                          "tokenizers only (use llama.cpp's convert_hf_to_gguf.py)", uri=uri, key="model")
    if model.get("byte_fallback"):
        raise FormatError(f"{uri} (tokenizer.json): a byte-fallback (SentencePiece-style) BPE tokenizer is not "
                          "exported to GGUF yet; use llama.cpp's convert_hf_to_gguf.py", uri=uri, key="model")
    vocab: dict[int, str] = {}
    for token, tid in model["vocab"].items():
        if isinstance(tid, int):
            vocab[tid] = token
    added: dict[int, dict[str, Any]] = {}
    for item in tokenizer.get("added_tokens") or []:
        if isinstance(item, dict) and isinstance(item.get("id"), int) and isinstance(item.get("content"), str):
            vocab[item["id"]] = item["content"]
            added[item["id"]] = item
    size = _vocab_size(config, len(vocab), rows, uri)
    if vocab and max(vocab) >= size:
        raise FormatError(f"{uri} (config.json): vocab_size {size!r} is smaller than the tokenizer's "
                          f"{max(vocab) + 1 if vocab else 0} tokens; fix config.json", uri=uri, key="vocab_size")
    tokens, types = [], []
    for i in range(size):
        token = vocab.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            if added[i].get("special") or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
            tokens.append(token)
        else:
            types.append(gguf.TokenType.NORMAL)
            tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or _pre_name(tokenizer, uri))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    _add_special(writer, side, uri, load_merges=True)


def _add_special(writer: gguf.GGUFWriter, side: dict[str, bytes], uri: str, load_merges: bool,
                 n_vocab: int | None = None) -> None:
    with tempfile.TemporaryDirectory(prefix="ckpt-gguf-vocab-") as folder:
        for name in SIDE:
            if name in side:
                with open(os.path.join(folder, name), "wb") as fh:
                    fh.write(side[name])
        try:
            special = gguf.SpecialVocab(folder, load_merges=load_merges, n_vocab=n_vocab)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FormatError(f"{uri} (tokenizer.json/tokenizer_config.json): cannot read the special tokens "
                              f"({type(exc).__name__}); fix the tokenizer files", uri=uri) from None
    special.add_to_gguf(writer, quiet=True)


def _add_spm(writer: gguf.GGUFWriter, side: dict[str, bytes], config: dict[str, Any], uri: str, rows: int) -> None:
    """SentencePiece: as llama.cpp's _create_vocab_sentencepiece (model "llama", pre "default", scores)."""
    found = spm.pieces(side["tokenizer.model"], uri)
    size = _vocab_size(config, len(found), rows, uri)
    tokens = [f"[PAD{i}]" for i in range(size)]
    scores = [-10000.0] * size
    types = [spm.UNUSED] * size
    for i, (piece, score, kind) in enumerate(found[:size]):
        tokens[i], scores[i] = piece, score
        types[i] = kind if kind in (spm.UNKNOWN, spm.CONTROL, spm.UNUSED, spm.BYTE) else spm.NORMAL

    def entries(name: str) -> dict[str, Any]:
        return json_object(side[name], name, uri) if name in side else {}

    for token, tid in entries("added_tokens.json").items():
        if isinstance(tid, int) and 0 <= tid < size:
            tokens[tid], scores[tid], types[tid] = token, -1000.0, spm.USER_DEFINED
    decoder = entries("tokenizer_config.json").get("added_tokens_decoder") or {}
    for key, data in decoder.items() if isinstance(decoder, dict) else ():
        tid = int(key) if isinstance(key, str) and key.isdecimal() else -1
        if not 0 <= tid < size or not isinstance(data, dict) or not isinstance(data.get("content"), str):
            continue
        token = data["content"]
        if data.get("special") or _looks_special(token):
            types[tid] = spm.CONTROL
        else:
            token = token.replace("\u2581", " ")
            types[tid] = spm.USER_DEFINED
        tokens[tid], scores[tid] = token, -1000.0
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    _add_special(writer, side, uri, load_merges=False, n_vocab=len(tokens))
