"""Streamed text is whole characters and ends in exactly ``tokenizer.decode``: a byte-level BPE (SmolLM2's,
what Llama 3, Qwen and GPT-2 use), a SentencePiece-style tokenizer with byte fallback (Llama 2, Gemma),
one that cleans up spaces before punctuation, on Japanese, Chinese, Korean and emoji text and on any ids."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from export.decoding.text_stream import REPLACEMENT, TextStream, stream_ids

TEXTS = ["こんにちは、元気ですか？", "わわわわ", "你好，世界。今天天气很好", "안녕하세요 여러분",
         "Emoji 🎉🎉 and 👩‍👩‍👧 family", "Le café est très bon.", "mixed ascii 日本 text\n\nnew 段落 ✓"]


def _pieces_are_whole(pieces: list[str], text: str) -> None:
    assert "".join(pieces) == text
    if REPLACEMENT not in text:  # no piece shows half a character
        assert all(REPLACEMENT not in p for p in pieces), pieces


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_bpe_streams_whole_characters(smollm2_tokenizer, text):
    ids = smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = stream_ids(smollm2_tokenizer, ids)
    _pieces_are_whole(pieces, smollm2_tokenizer.decode(ids, skip_special_tokens=True))
    assert "".join(pieces) == text


def test_the_issue_answer_streams_as_its_decode(smollm2_tokenizer):
    """The demo's answer to the Japanese prompt: each わ is ids 10391 and 233. Token by token, a naive stream
    printed a replacement character for every id; this one prints each わ once, whole."""
    ids = [10391, 233] * 12
    assert [smollm2_tokenizer.decode([i]) for i in ids[:2]] == [REPLACEMENT, REPLACEMENT]  # the naive stream
    pieces = stream_ids(smollm2_tokenizer, ids)
    assert pieces == ["わ"] * 12


@settings(max_examples=300, deadline=None, derandomize=True)
@given(ids=st.lists(st.one_of(st.integers(0, 49151), st.sampled_from([10391, 233, 7365, 237, 15107, 232, 227, 2])),
                    min_size=1, max_size=40))
def test_any_ids_end_in_exactly_the_decode(smollm2_tokenizer, ids):
    """Random ids, invalid byte sequences and special tokens among them: the pieces join to the decode, with
    special tokens skipped and kept."""
    for skip in (True, False):
        pieces = stream_ids(smollm2_tokenizer, ids, skip_special_tokens=skip)
        assert "".join(pieces) == smollm2_tokenizer.decode(ids, skip_special_tokens=skip)


def _byte_fallback_tokenizer(cleanup: bool = False):
    """A Llama-2-style SentencePiece BPE built in memory: ▁ for spaces, <0xNN> byte tokens for what the
    vocabulary lacks, the decoders Replace ▁, ByteFallback, Fuse, Strip (the first token's space)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "▁", "▁Hello", "▁world", "▁café", "!", ".", ",", "▁.", "a", "b", "こ", "▁日本"]
    vocab = {w: i for i, w in enumerate(words)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")  # words with their ▁, bytes after them
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    # transformers 5 ignores clean_up_tokenization_spaces for BPE unless told twice
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=cleanup,
                                   clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=cleanup)


def _wordpiece_tokenizer():
    """A BERT-style WordPiece tokenizer that cleans up spaces before punctuation, which its decoder puts
    between every two words: "hello ." becomes "hello." only once the "." comes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[CLS]", "[SEP]", "hello", "world", "play", "##ing", "##s", ".", ",", "!", "'", "s", "n't", "do"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=True)


@pytest.mark.parametrize("text", ["Hello world!", "Hello こんにちは 🎉 world.", "▁日本 café 한국어, done ."])
def test_byte_fallback_sentencepiece_streams_whole_characters(text):
    tok = _byte_fallback_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if not text.isascii():  # the characters the vocabulary lacks come as byte tokens
        assert any(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)
    pieces = stream_ids(tok, ids)
    _pieces_are_whole(pieces, tok.decode(ids, skip_special_tokens=True))


@pytest.mark.parametrize("cleanup", [False, True])
@settings(max_examples=300, deadline=None, derandomize=True)
@given(ids=st.lists(st.integers(0, 270), min_size=1, max_size=30))
def test_byte_fallback_any_ids_end_in_exactly_the_decode(cleanup, ids):
    """Invalid byte runs, broken by special tokens that are skipped, included; with spaces before punctuation
    cleaned up or not."""
    tok = _byte_fallback_tokenizer(cleanup)
    for skip in (True, False):
        assert "".join(stream_ids(tok, ids, skip_special_tokens=skip)) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(ids=st.lists(st.integers(0, 14), min_size=1, max_size=30))
def test_cleaned_up_spaces_any_ids_end_in_exactly_the_decode(ids):
    tok = _wordpiece_tokenizer()
    assert "".join(stream_ids(tok, ids)) == tok.decode(ids, skip_special_tokens=True)


def test_a_space_the_tokenizer_may_clean_up_is_held_until_the_next_token():
    """With clean_up_tokenization_spaces, "Hello", "▁", "." decodes to "Hello.": the space is not shown while
    the next token may still remove it; nor is the last word after a space ("do n't" becomes "don't")."""
    tok = _byte_fallback_tokenizer(cleanup=True)
    ids = tok.convert_tokens_to_ids(["▁Hello", "▁", "."])
    assert tok.decode(ids) == "Hello." and tok.decode(ids[:2]) == "Hello "
    seen: list[str] = []
    stream = TextStream(tok, seen.append)
    assert stream.push(ids[0]) == "Hello" and stream.push(ids[1]) == ""
    assert stream.push(ids[2]) == "." and stream.finish() == "Hello." and "".join(seen) == "Hello."
    wp = _wordpiece_tokenizer()
    assert stream_ids(wp, wp.convert_tokens_to_ids(["do", "n't", "play", "##ing", "."])) == ["do", "n't", " playing."]


def test_push_takes_several_ids_and_finish_is_idempotent(smollm2_tokenizer):
    ids = smollm2_tokenizer("日本語のテキスト", add_special_tokens=False)["input_ids"]
    seen: list[str] = []
    stream = TextStream(smollm2_tokenizer, seen.append)
    stream.push(ids[:3])
    stream.push(ids[3:])
    assert stream.finish() == "日本語のテキスト" == stream.finish() == "".join(seen) == stream.shown
    with pytest.raises(RuntimeError, match="push after finish"):
        stream.push(1)
