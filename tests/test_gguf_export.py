"""GGUF export for llama.cpp (converters.gguf_export), proven against llama.cpp's own convert_hf_to_gguf.py
(tests/gguf_reference.py fetches it): for tiny random Llama, Mixtral, Qwen2, Qwen3 and Qwen3-MoE models saved with
save_pretrained, with a real byte-level BPE tokenizer trained here with `tokenizers` (and a Mistral with a
SentencePiece tokenizer.model trained with `sentencepiece`), both write a GGUF from the same folder and the files hold
the same metadata keys (in order) and values, the same tensor names, types, shapes and bytes: the same file (slow:
the oracle loads the model); plus the Q/K permutation by hand and one-line refusals (fast).

CI needs: pip install gguf==0.19.0 and the llama-cpp-python==0.3.36 sdist in $CKPT_CI_CACHE (see gguf_reference).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from converters.errors import FormatError, OptionError

from . import gguf_reference
from .gguf_reference import LLAMA3_SPLIT, PRE, QWEN2_SPLIT, TEXT  # the tiny models (shared with
from .gguf_reference import tiny_model as _model  # test_gguf_runtime, which loads them in llama.cpp)
from .gguf_reference import train_tokenizer as _tokenizer

gguf = pytest.importorskip("gguf")  # gguf-py, which converters.gguf_export writes with
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from converters.gguf_export import export_gguf  # noqa: E402  (after the skip: it imports gguf)

ARCH = {"mixtral": "llama"}
#: every type for a dense model of each rope style; f16 and q8_0 for the rest
CASES = [(family, outtype) for family in ("llama", "qwen3") for outtype in ("f32", "f16", "bf16", "q8_0")] + \
    [(family, outtype) for family in ("qwen2", "qwen3moe", "mixtral") for outtype in ("f16", "q8_0")]


def _fields(path: Path) -> dict[str, tuple[list[int], object]]:
    reader = gguf.GGUFReader(path)
    return {k: (list(f.types), f.contents()) for k, f in reader.fields.items()}


def _tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    reader = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type.name, [int(n) for n in t.shape], t.data.tobytes()) for t in reader.tensors}


def _assert_same(ours: Path, theirs: Path) -> None:
    """Same keys (in the same order) and values, same tensors (names, order, types, shapes, bytes), same file."""
    mine, oracle = _fields(ours), _fields(theirs)
    assert list(mine) == list(oracle)
    for key, value in oracle.items():
        assert mine[key] == value, key
    mine_t, oracle_t = _tensors(ours), _tensors(theirs)
    assert list(mine_t) == list(oracle_t)
    for name, (qtype, shape, data) in oracle_t.items():
        assert mine_t[name][:2] == (qtype, shape), name
        assert mine_t[name][2] == data, name
    assert ours.read_bytes() == theirs.read_bytes()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-models")
    return {family: _model(family, root / family) for family in PRE}


@pytest.mark.slow
@pytest.mark.parametrize(("family", "outtype"), CASES)
def test_same_file_as_llama_cpp(models: dict[str, Path], tmp_path: Path, family: str, outtype: str) -> None:
    theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    gguf_reference.convert(models[family], theirs, outtype, PRE[family])
    result = export_gguf(str(models[family]), str(ours), outtype)
    _assert_same(ours, theirs)
    fields = _fields(ours)
    assert fields["general.architecture"][1] == ARCH.get(family, family)
    assert fields["general.file_type"][1] == {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}[outtype]
    assert fields["tokenizer.ggml.pre"][1] == PRE[family]
    assert result.bytes == ours.stat().st_size and result.architecture == ARCH.get(family, family)
    types = {name: t[0] for name, t in _tensors(ours).items()}
    assert types["blk.0.attn_norm.weight"] == "F32"  # norms stay F32 in every type
    assert types["blk.0.attn_q.weight"] == outtype.upper()
    if family in ("qwen3moe", "mixtral"):
        assert types["blk.0.ffn_gate_inp.weight"] == "F32"  # the router too
        n_ff = 48 if family == "qwen3moe" else 96
        assert _tensors(ours)["blk.0.ffn_gate_exps.weight"][1] == [64, n_ff, 4]  # ne: {n_embd, n_ff_exp, E}
        assert _tensors(ours)["blk.0.ffn_down_exps.weight"][1] == [n_ff, 64, 4]


@pytest.mark.slow
def test_odd_shapes_f16_source_and_tied_embeddings(tmp_path: Path) -> None:
    """A float16 Llama whose down_proj rows are not whole Q8_0 blocks (llama.cpp writes them F16) and whose
    embeddings are tied (no output.weight)."""
    torch.manual_seed(1)
    folder = tmp_path / "odd"
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=72, num_hidden_layers=1,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).to(torch.float16).save_pretrained(folder)
    _tokenizer(folder, LLAMA3_SPLIT)
    for outtype in ("q8_0", "bf16"):
        theirs, ours = tmp_path / f"theirs-{outtype}.gguf", tmp_path / f"ours-{outtype}.gguf"
        gguf_reference.convert(folder, theirs, outtype, "llama-bpe")
        export_gguf(str(folder), str(ours), outtype)
        _assert_same(ours, theirs)
    types = {name: t[0] for name, t in _tensors(tmp_path / "ours-q8_0.gguf").items()}
    assert types["blk.0.ffn_down.weight"] == "F16" and types["blk.0.ffn_up.weight"] == "Q8_0"
    assert "output.weight" not in types


@pytest.mark.slow
def test_llama3_rope_scaling_writes_rope_freqs(tmp_path: Path) -> None:
    """Llama 3.1-style rope scaling: llama.cpp's converter computes a rope_freqs tensor (and no scaling keys)."""
    torch.manual_seed(2)
    folder = tmp_path / "llama3"
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                      rope_parameters=rope)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    _tokenizer(folder, LLAMA3_SPLIT)
    theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    gguf_reference.convert(folder, theirs, "q8_0", "llama-bpe")
    export_gguf(str(folder), str(ours), "q8_0")
    _assert_same(ours, theirs)
    qtype, shape, data = _tensors(ours)["rope_freqs.weight"]
    assert (qtype, shape) == ("F32", [16])
    assert set(torch.frombuffer(bytearray(data), dtype=torch.float32).tolist()) > {1.0, 8.0}  # and smoothed ones


@pytest.mark.slow
def test_fused_experts_as_llama_cpp_writes_them_unfused(models: dict[str, Path], tmp_path: Path) -> None:
    """Experts saved fused (mlp.experts.gate_up_proj [E, 2*ff, hidden], down_proj [E, hidden, ff], transformers'
    in-memory layout) give the same file as llama.cpp writes from the per-expert checkpoint."""
    from safetensors.torch import load_file, save_file

    source = models["qwen3moe"]
    fused = tmp_path / "fused" / source.name  # general.name comes from the folder's name
    fused.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (fused / name).write_bytes((source / name).read_bytes())
    tensors = load_file(source / "model.safetensors")
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        experts = range(4)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(
            [tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"]]) for e in experts])
        out[f"{prefix}.down_proj"] = torch.stack([tensors[f"{prefix}.{e}.down_proj.weight"] for e in experts])
    save_file(out, fused / "model.safetensors", metadata={"format": "pt"})
    theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    gguf_reference.convert(source, theirs, "q8_0", "qwen2")
    export_gguf(str(fused), str(ours), "q8_0")
    mine, oracle = _tensors(ours), _tensors(theirs)
    assert sorted(mine) == sorted(oracle)
    for name, value in oracle.items():
        assert mine[name] == value, name
    assert _fields(ours) == _fields(theirs)


def _spm_model(folder: Path) -> Path:
    """A tiny Mistral (llama arch in GGUF) with a SentencePiece tokenizer.model trained here (byte fallback, a
    user-defined and a control piece) beside the tokenizer.json transformers writes from it, as Llama 2 / Mistral
    repositories ship both; llama.cpp's converter takes tokenizer.model first."""
    import io

    sentencepiece = pytest.importorskip("sentencepiece")
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=352, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        tie_word_embeddings=False)
    transformers.MistralForCausalLM(config).save_pretrained(folder)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT), model_writer=model, vocab_size=340, model_type="bpe", byte_fallback=True,
        user_defined_symbols=["<tool>"], control_symbols=["<ctl>"], minloglevel=2)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    transformers.LlamaTokenizer(vocab_file=str(folder / "tokenizer.model")).save_pretrained(folder)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    return folder


@pytest.mark.slow
def test_sentencepiece_tokenizer_as_llama_cpp(tmp_path: Path) -> None:
    folder = _spm_model(tmp_path / "mistral")
    theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    gguf_reference.convert(folder, theirs, "q8_0")
    export_gguf(str(folder), str(ours), "q8_0")
    _assert_same(ours, theirs)
    fields = _fields(ours)
    assert (fields["tokenizer.ggml.model"][1], fields["tokenizer.ggml.pre"][1]) == ("llama", "default")
    tokens, types = fields["tokenizer.ggml.tokens"][1], fields["tokenizer.ggml.token_type"][1]
    assert isinstance(tokens, list) and isinstance(types, list) and len(tokens) == 352
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and types[:3] == [2, 3, 3] and tokens[-1] == "[PAD351]"
    assert 6 in types  # byte pieces


CARD = """---
license: apache-2.0
base_model: Qwen/Qwen3-0.6B
tags:
- text-generation
- tiny
language:
- en
- no
---
# A tiny model
"""


@pytest.mark.slow
def test_model_card_metadata_as_llama_cpp(models: dict[str, Path], tmp_path: Path) -> None:
    """README.md's front matter (license, base model, tags, languages) goes into general.* as llama.cpp puts it."""
    import shutil

    folder = tmp_path / "card"
    shutil.copytree(models["qwen3"], folder)
    (folder / "README.md").write_text(CARD)
    theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    gguf_reference.convert(folder, theirs, "f16", "qwen2")
    export_gguf(str(folder), str(ours), "f16")
    _assert_same(ours, theirs)
    fields = _fields(ours)
    assert fields["general.license"][1] == "apache-2.0" and fields["general.languages"][1] == ["en", "no"]
    assert fields["general.base_model.0.repo_url"][1] == "https://huggingface.co/Qwen/Qwen3-0.6B"


# ---------------------------------------------------------------- the parts, and refusals (fast)

def test_qk_permutation_rows() -> None:
    """llama.cpp's permute for one head of 8 rows: rows 0,4,1,5,2,6,3,7 (read back from our writer's reader)."""
    from converters.gguf_export.names import Part
    from converters.gguf_export.writer import Reader
    from converters.index import TensorEntry

    class Rows(Reader):
        def _read(self, part: Part, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
            return torch.arange(16, dtype=torch.float32).reshape(16, 1)[offsets[0]: offsets[0] + sizes[0]]

    part = Part(TensorEntry("q_proj.weight", "float32", (16, 1), []), (0, 0), (16, 1), heads=2)
    rows = torch.cat(list(Rows(None, 8 * 4).slabs(part)))  # type: ignore[arg-type]  # one head per slab
    assert rows[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]


def _small(folder: Path, tokenizer: bool = True) -> Path:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=64)
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    if tokenizer:
        _tokenizer(folder, QWEN2_SPLIT)
    return folder


def test_refuses_damaged_tokenizer_model(tmp_path: Path) -> None:
    source = _small(tmp_path / "model")
    (source / "tokenizer.model").write_bytes(b"\xff" * 16)
    with pytest.raises(FormatError) as exc:
        export_gguf(str(source), str(tmp_path / "out.gguf"))
    assert _one_line(exc) == (f"{source} (tokenizer.model): not a SentencePiece model (no pieces could be read); "
                              "replace the file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_refuses_unreadable_model_card(tmp_path: Path) -> None:
    source = _small(tmp_path / "model")
    (source / "README.md").write_text("---\nlicense: [unclosed\n---\n")
    with pytest.raises(FormatError) as exc:
        export_gguf(str(source), str(tmp_path / "out.gguf"))
    assert _one_line(exc) == (f"{source} (README.md): its front matter cannot be read (ParserError); fix or remove "
                              "README.md")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_dcp_source_and_object_storage_give_the_same_file(tmp_path: Path) -> None:
    """Any source the engine reads: a torch.distributed.checkpoint of the same weights (config and tokenizer taken
    with config_from) and the HF folder on object storage, written to object storage, give the local file's bytes
    (which the slow tests prove equal to llama.cpp's)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from converters import storage

    source = _small(tmp_path / "hf" / "model")
    export_gguf(str(source), str(tmp_path / "local.gguf"), "q8_0")
    expected = (tmp_path / "local.gguf").read_bytes()
    dcp.save({"model": load_file(source / "model.safetensors")}, checkpoint_id=str(tmp_path / "dcp" / "model"))
    export_gguf(str(tmp_path / "dcp" / "model"), str(tmp_path / "dcp.gguf"), "q8_0", config_from=str(source))
    assert (tmp_path / "dcp.gguf").read_bytes() == expected
    fs, _ = storage.filesystem("memory://gguf-src")
    for item in source.iterdir():
        fs.pipe(f"/gguf-src/model/{item.name}", item.read_bytes())
    result = export_gguf("memory://gguf-src/model", "memory://gguf-out/model.gguf", "q8_0")
    assert storage.read_all("memory://gguf-out/model.gguf", len(expected) + 1) == expected
    assert result.bytes == len(expected)


def test_refuses_vocab_size_past_the_embedding(tmp_path: Path) -> None:
    source = _small(tmp_path / "model")
    config = json.loads((source / "config.json").read_text())
    config["vocab_size"] = 10**12  # would be a token list of 10**12 entries
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError) as exc:
        export_gguf(str(source), str(tmp_path / "out.gguf"))
    assert _one_line(exc) == (f"{source} (config.json): vocab_size 1000000000000 does not fit the 320 rows of the "
                              "token embedding; fix config.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def _one_line(exc: pytest.ExceptionInfo[Exception]) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_refuses_missing_tokenizer_in_one_line(tmp_path: Path) -> None:
    source = _small(tmp_path / "model", tokenizer=False)
    target = tmp_path / "out.gguf"
    with pytest.raises(OptionError) as exc:
        export_gguf(str(source), str(target))
    assert _one_line(exc) == (f"{source}: no tokenizer beside the checkpoint; llama.cpp needs tokenizer.json (a "
                              "byte-level BPE tokenizer) or tokenizer.model (SentencePiece): put it in the source "
                              "folder or pass config_from=DIR")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing left behind


def test_refusals_exit_two() -> None:
    from ckpt_service.service_errors import exit_code

    assert exit_code(OptionError("x")) == 2 and exit_code(FormatError("x")) == 2


def test_refuses_unknown_family_outtype_and_pre_tokenizer(tmp_path: Path) -> None:
    source = _small(tmp_path / "model")
    with pytest.raises(OptionError) as exc:
        export_gguf(str(source), str(tmp_path / "out.gguf"), "q4_k")
    assert _one_line(exc) == "outtype 'q4_k' is not one of f32, f16, bf16, q8_0"
    with pytest.raises(OptionError) as exc:
        export_gguf(str(source), str(tmp_path / "out"))
    assert _one_line(exc) == f"{tmp_path / 'out'}: a GGUF export is one file; name it <name>.gguf"
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError) as exc:
        export_gguf(str(source), str(tmp_path / "out.gguf"))
    assert _one_line(exc) == (f"{source} (config.json): 'GPT2LMHeadModel' is not a family the GGUF export knows (it "
                              "knows LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, "
                              "Qwen3ForCausalLM, Qwen3MoeForCausalLM); set architectures or use llama.cpp's "
                              "convert_hf_to_gguf.py")
    config["architectures"] = ["Qwen3ForCausalLM"]
    (source / "config.json").write_text(json.dumps(config))
    doc = json.loads((source / "tokenizer.json").read_text())
    doc["pre_tokenizer"] = {"type": "Whitespace"}
    (source / "tokenizer.json").write_text(json.dumps(doc))
    with pytest.raises(FormatError) as exc:
        export_gguf(str(source), str(tmp_path / "out.gguf"))
    assert _one_line(exc) == (f"{source} (tokenizer.json): its pre-tokenizer is not one the GGUF export recognizes; "
                              "pass tokenizer_pre=NAME (llama.cpp's name for it, e.g. llama-bpe, qwen2)")
    export_gguf(str(source), str(tmp_path / "out.gguf"), "f32", tokenizer_pre="qwen2")
    assert _fields(tmp_path / "out.gguf")["tokenizer.ggml.pre"][1] == "qwen2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out.gguf", "out.gguf.ckpt-manifest.json"]


def test_refuses_a_setting_llama_cpp_would_ignore(tmp_path: Path) -> None:
    """llama.cpp's qwen3moe always renormalises the chosen experts' weights and its converter does not record
    norm_topk_prob: a model without it would load and compute other logits, so the export refuses it."""
    source = _small(tmp_path / "model")
    config = json.loads((source / "config.json").read_text())
    for setting in ({"norm_topk_prob": False}, {}):
        (source / "config.json").write_text(json.dumps({**config, **setting,
                                                        "architectures": ["Qwen3MoeForCausalLM"]}))
        with pytest.raises(FormatError) as exc:
            export_gguf(str(source), str(tmp_path / "out.gguf"))
        said = repr(setting.get("norm_topk_prob"))
        assert _one_line(exc) == (f"{source} (config.json): norm_topk_prob is {said}, but llama.cpp's qwen3moe always "
                                  "renormalises the chosen experts' router weights (norm_topk_prob=True), so the GGUF "
                                  "would compute other logits; no GGUF export serves this model (llama.cpp's own "
                                  "converter writes one anyway)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_export_gguf_option_offline_and_as_a_job(tmp_path: Path) -> None:
    """`ckptctl export SRC OUT.gguf --gguf q8_0` and an export job with `options.gguf` write the engine's file."""
    from fastapi.testclient import TestClient
    from typer.testing import CliRunner

    from api.app import create_app
    from ckpt_service.settings import Settings
    from ckptctl import app as cli

    from .service_harness import run_here

    source = _small(tmp_path / "llama")
    export_gguf(str(source), str(tmp_path / "direct.gguf"), "q8_0")
    run = CliRunner().invoke(cli, ["export", str(source), str(tmp_path / "cli.gguf"), "--gguf", "Q8_0", "-q"])
    assert run.exit_code == 0, run.output
    assert (tmp_path / "cli.gguf").read_bytes() == (tmp_path / "direct.gguf").read_bytes()
    refused = CliRunner().invoke(cli, ["export", str(source), str(tmp_path / "x.gguf"), "--gguf", "q4_k"])
    assert (refused.exit_code, refused.output.strip()) == (2, "error: --gguf: unknown GGUF type 'q4_k'; choose one of "
                                                               "f32, f16, bf16, q8_0")
    settings = Settings(data_dir=tmp_path / "state", read_roots=[str(tmp_path)], write_roots=[str(tmp_path)])
    settings.prepare()
    with TestClient(create_app(settings)) as client:
        done = run_here(client, {"kind": "export", "source": str(source), "target": str(tmp_path / "job.gguf"),
                                 "options": {"gguf": "q8_0"}})
    assert done["state"] == "succeeded", done
    assert done["result"]["total_bytes"] == (tmp_path / "job.gguf").stat().st_size
    assert (tmp_path / "job.gguf").read_bytes() == (tmp_path / "direct.gguf").read_bytes()
