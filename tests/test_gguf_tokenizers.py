"""A GGUF file's tokenizer gives llama.cpp's ids. llama.cpp's own vocabulary files and test vectors (the ids its
test-tokenizer-0 checks, written from each model's Hugging Face tokenizer) are the reference: every vocabulary
there of a kind llama-jax rebuilds (SentencePiece, and each byte-level pre-tokenizer with a file) encodes every test
text to those ids and decodes them back to the text. The BOS / EOS a text gets follow the file's flags, else
llama.cpp's default for the vocabulary; special tokens written in a text are parsed as tokens; the files'
hyperparameters are read as the real models' (Llama-2-7B, Llama-3-8B, deepseek-coder's linear RoPE ×4)."""

from __future__ import annotations

import pytest

import llama_jax
from llama_jax.core.config import LlamaConfig
from llama_jax.errors import CheckpointError
from llama_jax.loaders.gguf_file import GGUFFile
from llama_jax.testing import random_tensors, tiny_config
from llama_jax.text.gguf_vocab import gguf_backend
from llama_jax.text.pre_tokenizers import PRE_TOKENIZERS
from tests.gguf_builder import gguf_metadata, write_gguf
from tests.helpers import llama_cpp_models

# the vocabularies with test vectors: SentencePiece (Llama 2; Phi-3's is the same kind), then byte-level BPE by
# pre-tokenizer
WITH_VECTORS = (
    "llama-spm",
    "phi-3",
    "llama-bpe",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gpt-2",
    "mpt",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
    "command-r",
)
_SEPARATOR = "\n__ggml_vocab_test__\n"  # llama.cpp's test-tokenizer-0 splits the .inp file at it


@pytest.fixture(scope="module")
def models_dir():
    return llama_cpp_models()


def _tokenizer(models_dir, name: str) -> llama_jax.Tokenizer:
    return llama_jax.load_tokenizer(models_dir / f"ggml-vocab-{name}.gguf")


@pytest.mark.parametrize("name", WITH_VECTORS)
def test_every_llama_cpp_test_vector_encodes_to_its_ids_and_decodes_back(models_dir, name):
    tok = _tokenizer(models_dir, name)
    texts = (models_dir / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split(_SEPARATOR)
    expected = (models_dir / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(texts) == len(expected) >= 40
    got = [tok.encode(text, add_special=False) for text in texts]
    assert got == [[int(i) for i in line.split()] for line in expected]
    assert [tok.decode(ids) for ids in got] == texts


@pytest.mark.parametrize(
    "name, add_bos",
    [
        ("llama-spm", True),  # the file's flag
        ("deepseek-coder", True),  # the file's flag
        ("llama-bpe", True),  # no flag: llama.cpp's default for Llama 3's pre-tokenizer (transformers' too)
        ("gpt-2", False),  # no flag: byte-level BPE's default
    ],
)
def test_bos_follows_the_flag_else_llama_cpp_default(models_dir, name, add_bos):
    tok = _tokenizer(models_dir, name)
    plain = tok.encode("Hello world", add_special=False)
    assert (tok.special.add_bos, tok.special.add_eos) == (add_bos, False)
    assert tok.encode("Hello world") == [tok.special.bos] * add_bos + plain


def test_special_tokens_written_in_a_text_are_tokens(models_dir):
    spm = _tokenizer(models_dir, "llama-spm")
    assert spm.encode("Hi</s>", add_special=False) == [*spm.encode("Hi", add_special=False), spm.special.eos]
    llama3 = _tokenizer(models_dir, "llama-bpe")
    eot = llama3.token_id("<|eot_id|>")
    ids = llama3.encode("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>")
    assert ids[:2] == [llama3.special.bos, llama3.token_id("<|start_header_id|>")] and ids[-1] == eot
    assert llama3.decode(ids, skip_special=True) == "user\n\nHi"


@pytest.mark.parametrize(
    "name, sizes, rope",
    [
        ("llama-spm", (32, 4096, 11008, 32, 32, 32000, 10000.0), "default"),  # Llama-2-7B
        ("llama-bpe", (32, 4096, 14336, 32, 8, 128256, 500000.0), "default"),  # Llama-3-8B
        ("deepseek-coder", (32, 4096, 11008, 32, 32, 32256, 100000.0), "linear"),  # deepseek-coder-6.7b
    ],
)
def test_the_files_hyperparameters_are_the_real_models(models_dir, name, sizes, rope):
    meta = GGUFFile(models_dir / f"ggml-vocab-{name}.gguf").metadata
    config = LlamaConfig.from_gguf(meta, tied=False, source=name)
    assert (config.layers, config.dim, config.ffn, config.heads, config.kv, config.vocab, config.theta) == sizes
    assert config.rope.kind == rope and config.rope.factor == (4.0 if rope == "linear" else 1.0)


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_held_pre_tokenizer_cuts_a_text_that_decodes_back(pre):
    """The rows without a llama.cpp vocabulary file: their patterns compile, and a text of many scripts and
    characters comes back from its ids."""
    meta = gguf_metadata(tiny_config()) | {"tokenizer.ggml.pre": pre}
    tok = llama_jax.Tokenizer(gguf_backend(meta, pre))
    text = "Hello, World! It's 2024: 12345 ÄÖÜ Ωμέγα 你好，世界。 'RE we'LL\n\n\t  done?  "
    assert tok.decode(tok.encode(text)) == text


def test_a_kind_or_pre_tokenizer_not_held_is_refused_by_name():
    meta = gguf_metadata(tiny_config())
    with pytest.raises(CheckpointError, match=r"tokenizer\.ggml\.model is 'bert'"):
        gguf_backend(meta | {"tokenizer.ggml.model": "bert"}, "f.gguf")
    with pytest.raises(CheckpointError, match=r"tokenizer\.ggml\.pre 'kimi-k2'.*Hugging Face directory"):
        gguf_backend(meta | {"tokenizer.ggml.pre": "kimi-k2"}, "f.gguf")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-spm", "llama-bpe"])
def test_a_model_file_of_a_real_vocabulary_loads_and_converts_to_a_tokenizer_transformers_reads_alike(
    models_dir, tmp_path, name
):
    """A small random model written with Llama 2's or Llama 3's tokenizer metadata, as llama.cpp's converter writes
    it: it loads with that tokenizer, and its converted directory's tokenizer.json gives transformers llama.cpp's
    ids (transformers' own GGUF tokenizer does not for these files: it puts no space before a leading space and no
    BOS before a Llama 3 text)."""
    from transformers import AutoTokenizer

    vocab_meta = GGUFFile(models_dir / f"ggml-vocab-{name}.gguf").metadata
    tokenizer_meta = {key.replace(".", "__"): v for key, v in vocab_meta.items() if key.startswith("tokenizer.")}
    config = tiny_config(vocab=len(vocab_meta["tokenizer.ggml.tokens"]), layers=1)
    path = write_gguf(tmp_path / f"{name}.gguf", config, random_tensors(config), **tokenizer_meta)
    texts = (models_dir / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split(_SEPARATOR)
    reference = _tokenizer(models_dir, name)
    expected = [reference.encode(text) for text in texts]
    model = llama_jax.load(path)
    assert [model.tokenizer.encode(text) for text in texts] == expected
    converted = llama_jax.convert_gguf(path, tmp_path / "converted")
    hf = AutoTokenizer.from_pretrained(converted)
    assert [hf.encode(text) for text in texts] == expected
    assert [hf.decode(ids, skip_special_tokens=True) for ids in expected] == texts


@pytest.mark.parametrize("name", WITH_VECTORS)
def test_each_test_vectors_token_pieces_join_to_its_text(models_dir, name):
    """A token's piece (`token_bytes`, the server's /tokenize with_pieces) is its bytes as llama.cpp's
    token_to_piece gives them: a test text's pieces join to its UTF-8 bytes (a SentencePiece vocabulary's added
    leading space aside)."""
    tok = _tokenizer(models_dir, name)
    texts = (models_dir / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split(_SEPARATOR)
    for text in texts:
        joined = b"".join(tok.token_bytes(i) for i in tok.encode(text, add_special=False))
        assert joined in (text.encode(), b" " + text.encode()), text


@pytest.mark.parametrize("name", ["llama-spm", "llama-bpe", "qwen2"])
def test_the_server_s_tokenize_and_detokenize_round_trip_the_test_vectors(models_dir, name):
    """`llama-jax serve`'s /tokenize (llama-server's content, add_special false) gives each test text llama.cpp's ids,
    its pieces join to the text's bytes, and /detokenize gives the text back: the server's app in this process over
    a tiny model holding the file's vocabulary."""
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from llama_jax.loaders.checkpoint import Checkpoint
    from llama_jax.serve.app import Server
    from llama_jax.testing import random_weights

    tok = _tokenizer(models_dir, name)
    config = tiny_config(vocab=tok.vocab_size)
    model = llama_jax.Model(Checkpoint(config, random_weights(config), tok, None, (0,), name))
    client = TestClient(Server(model, name).app)
    texts = (models_dir / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split(_SEPARATOR)
    expected = (models_dir / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    for text, line in zip(texts, expected, strict=True):
        ids = client.post("/tokenize", json={"content": text}).json()["tokens"]
        assert ids == [int(i) for i in line.split()], text
        pieces = client.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
        joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
        assert joined in (text.encode(), b" " + text.encode()), text
        assert client.post("/detokenize", json={"tokens": ids}).json()["content"] == text
