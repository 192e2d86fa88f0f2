"""Tokenizer wrapper, streaming detokenization and stop strings."""

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from pd_cluster.tokenizer import (
    IncrementalDetokenizer,
    StopChecker,
    Tokenizer,
    _plain_fast_tokenizer,
    find_stop,
    load_tokenizer,
    partial_stop_length,
)
from tests.support.texts import MULTILINGUAL


def _stream(
    tokenizer: Tokenizer, ids: list[int], step: int, prompt: Sequence[int] = ()
) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    chunks = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    return chunks + [detok.flush()]


@pytest.mark.parametrize("step", [1, 3])
def test_streamed_text_equals_full_decode_without_broken_characters(
    tokenizer: Tokenizer, step: int
) -> None:
    ids = tokenizer.encode(MULTILINGUAL)
    chunks = _stream(tokenizer, ids, step)
    assert "".join(chunks) == tokenizer.decode(ids) == MULTILINGUAL
    assert not any("\ufffd" in c for c in chunks)
    if step == 1:
        assert "" in chunks[:-1]  # some character really was split over tokens and held back


def test_streaming_after_a_prompt_skips_special_tokens(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi"}])
    output = tokenizer.encode("Hi! 😊 ça va?") + [2]  # 2 = <|im_end|>
    assert "".join(_stream(tokenizer, output, 1, prompt)) == "Hi! 😊 ça va?"


def test_detokenizer_decodes_a_bounded_window(tokenizer: Tokenizer) -> None:
    lengths: list[int] = []
    decode = tokenizer.decode

    class Recording(Tokenizer):
        def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
            lengths.append(len(ids))
            return decode(ids, skip_special_tokens)

    recording = Recording(tokenizer.hf, tokenizer.eos_token_ids)
    ids = tokenizer.encode(MULTILINGUAL * 10)
    assert "".join(_stream(recording, ids, 1)) == MULTILINGUAL * 10
    assert len(ids) > 200 and max(lengths) <= 8


def test_flush_returns_an_unfinished_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[:1]) == ""
    assert detok.flush() == tokenizer.decode(ids[:1])


def test_chat_template_renders_chatml(tokenizer: Tokenizer) -> None:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(1) == 3  # <|im_start|> is one special token, never split or doubled


def test_default_model_eos_and_plain_encode(tokenizer: Tokenizer) -> None:
    assert tokenizer.eos_token_ids == frozenset({2})
    assert tokenizer.encode("The capital of France is") == [504, 3575, 282, 4649, 314]


def test_directory_without_tokenizer_files_gives_none(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None


def _word_level_tokenizer_dir(path: Path, generation_eos: object) -> Path:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "<eot>": 2, "hello": 3, "world": 4}
    raw = RawTokenizer(WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>")
    hf.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


@pytest.mark.parametrize(("generation_eos", "expected"), [(2, {1, 2}), ([1, 2], {1, 2})])
def test_eos_ids_merge_tokenizer_and_generation_config(
    tmp_path: Path, generation_eos: object, expected: set[int]
) -> None:
    tokenizer = load_tokenizer(_word_level_tokenizer_dir(tmp_path, generation_eos))
    assert tokenizer is not None
    assert tokenizer.eos_token_ids == expected
    assert tokenizer.encode("hello world") == [3, 4]


def test_chat_without_template_is_a_value_error(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(_word_level_tokenizer_dir(tmp_path, 1))
    assert tokenizer is not None and not tokenizer.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])


def test_stop_helpers() -> None:
    assert find_stop("abc STOP x END", ["END", "STOP"]) == 4
    assert find_stop("abc", ["x"]) is None
    assert partial_stop_length("hello wor", ["world", "o"]) == 3
    assert partial_stop_length("hello", ["hello"]) == 0  # a whole stop is a match, not a prefix


def test_stop_string_truncates_and_is_never_streamed() -> None:
    stop = StopChecker(["</answer>"])
    streamed = [stop.append(c) for c in ["The answer", " is 4</", "ans", "wer> trailing"]]
    assert streamed == ["The answer", " is 4", "", ""]
    assert stop.stopped and stop.text == "The answer is 4"


def test_held_back_prefix_is_released_when_it_is_not_a_stop() -> None:
    stop = StopChecker(["\n\n"])
    assert stop.append("line one\n") == "line one"
    assert stop.append("line two\n") == "\nline two"
    assert stop.flush() == "\n" and not stop.stopped


def test_stream_is_always_a_prefix_of_the_final_output() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n_stops = rng.randint(1, 3)
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 4))) for _ in range(n_stops)]
        text = "".join(rng.choices("abc", k=rng.randint(0, 20)))
        cut = find_stop(text, stops)
        expected = text if cut is None else text[:cut]
        checker, shown, i = StopChecker(stops), "", 0
        while i < len(text) and not checker.stopped:
            n = rng.randint(1, 4)
            shown += checker.append(text[i : i + n])
            i += n
            assert expected.startswith(shown), (stops, text, shown)
        shown += checker.flush()
        assert shown == expected == checker.text and checker.stopped == (cut is not None)


def test_generic_fast_tokenizer_loads_what_auto_tokenizer_would(
    tokenizer: Tokenizer, default_model_dir: str
) -> None:
    # The default model's tokenizer_config names PreTrainedTokenizerFast: loaded directly.
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(default_model_dir)
    assert type(tokenizer.hf) is type(auto)
    assert tokenizer.hf.all_special_tokens == auto.all_special_tokens
    assert tokenizer.encode(MULTILINGUAL) == list(auto.encode(MULTILINGUAL))
    chat = [{"role": "user", "content": MULTILINGUAL}]
    text = auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(chat) == list(auto.encode(text, add_special_tokens=False))
    assert _plain_fast_tokenizer(Path(default_model_dir))      # and it took the direct path


def test_a_tokenizer_class_of_its_own_goes_through_auto_tokenizer(tmp_path: Path) -> None:
    path = _word_level_tokenizer_dir(tmp_path, 1)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    assert not _plain_fast_tokenizer(path)
    tokenizer = load_tokenizer(path)
    assert tokenizer is not None and type(tokenizer.hf).__name__ == "GPT2Tokenizer"
