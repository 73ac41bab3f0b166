from __future__ import annotations

import pytest

from moeinf.hf.tokenizer import ByteTokenizer, chat_prompt, load_tokenizer

TEXTS = ["Hello, world!", "Grüße — 你好 🙂", "", "line\nbreak\ttab"]


@pytest.mark.parametrize("vocab_size, layout", [(128, "nibble"), (300, "byte"), (32000, "byte")])
def test_roundtrip_and_ids_within_vocab(vocab_size: int, layout: str) -> None:
    tok = ByteTokenizer(vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    assert tok.layout == layout
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 1
        assert all(0 <= i < vocab_size for i in ids)
        assert not set(ids[1:]) & {0, 1, 2}
        assert tok.decode(ids) == text
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_decode_of_arbitrary_ids_never_fails() -> None:
    tok = ByteTokenizer(128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    hi = tok.encode("A", add_special_tokens=False)[0]
    assert tok.decode([hi]) == "\ufffd"  # a high nibble without its low nibble
    assert tok.decode([100, 101]) == "\ufffd\ufffd"  # ids outside the byte map
    assert tok.decode(tok.encode("ok") + [2, 0]) == "ok"
    assert tok.decode(tok.encode("ok") + [2], skip_special_tokens=False) == "<bos>ok<eos>"


def test_too_small_vocab_is_refused() -> None:
    with pytest.raises(ValueError, match="add tokenizer files"):
        ByteTokenizer(20)


def test_fallback_for_a_model_dir_without_tokenizer(tiny_model_dir) -> None:
    tok, kind = load_tokenizer(tiny_model_dir("qwen3_moe"))
    assert kind == "byte-fallback" and isinstance(tok, ByteTokenizer)
    assert tok.vocab_size == 128 and tok.eos_token_id == 2 and tok.pad_token_id == 0
    assert tok.decode(tok.encode("2 + 2 = 4")) == "2 + 2 = 4"
    switch, _ = load_tokenizer(tiny_model_dir("switch_transformers"))
    assert 0 in switch.all_special_ids and 1 in switch.all_special_ids


def test_model_tokenizer_is_loaded_when_present(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "[UNK]": 5}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="</s>",
                            unk_token="[UNK]").save_pretrained(tmp_path)
    tok, kind = load_tokenizer(tmp_path)
    assert kind == "model"
    assert tok.encode("hello world") == [3, 4]
    assert tok.decode([3, 4]) == "hello world"


def test_chat_prompt_plain_format() -> None:
    tok = ByteTokenizer(128)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert chat_prompt(tok, messages) == "System: Be brief.\nUser: Hi\nAssistant:"


def test_fallback_is_called_like_a_transformers_tokenizer() -> None:
    tok = ByteTokenizer(600, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    batch = tok("Hello", return_tensors="pt")
    assert batch.input_ids.tolist() == [tok.encode("Hello")]
    assert batch.attention_mask.tolist() == [[1] * len(tok.encode("Hello"))]
    assert tok("Hi")["input_ids"] == tok.encode("Hi")
    assert tok(["ab", "cd"], add_special_tokens=False, return_tensors="pt").input_ids.shape == (2, 2)
    with pytest.raises(ValueError, match="does not pad"):
        tok(["a", "abc"], return_tensors="pt")
