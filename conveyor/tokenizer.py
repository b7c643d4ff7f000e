"""Tokenizer (HF directory or GGUF), chat templates, incremental detokenization."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

if TYPE_CHECKING:
    import gguf

REPLACEMENT_CHAR = "\ufffd"

# GGUF token_type values (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

# End-of-turn tokens of common chat formats: Gemma, Llama 3, ChatML (Qwen, SmolLM), Phi-3. A GGUF
# names one eos, often the end-of-document token (Gemma's is <eos>, id 1), while a chat model ends
# its turn with one of these; like llama.cpp's end-of-generation set, generation stops on them too
# when the vocabulary has them as control tokens. <|endoftext|> is left out on purpose: some
# vocabularies use it as a document separator the model may write within its turn.
_END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>")

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

# tokenizer.ggml.pre -> (split regexes applied in order, ignore_merges). As in llama.cpp, each regex
# splits the pieces left by the previous one; the last piece is the GPT-2 byte-to-unicode mapping.
_GGUF_PRE: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": ((_GPT2_SPLIT,), False),
    "gpt-2": ((_GPT2_SPLIT,), False),
    # The starcoder family isolates every digit first (HF: Digits(individual_digits) + ByteLevel).
    "smollm": ((r"\p{N}", _GPT2_SPLIT), False),
    "starcoder": ((r"\p{N}", _GPT2_SPLIT), False),
    "refact": ((r"\p{N}", _GPT2_SPLIT), False),
    "llama3": ((_LLAMA3_SPLIT,), True),
    "llama-v3": ((_LLAMA3_SPLIT,), True),
    "llama-bpe": ((_LLAMA3_SPLIT,), True),
    "qwen2": ((_QWEN2_SPLIT,), False),
    "deepseek-r1-qwen": ((_QWEN2_SPLIT,), False),
}


# Gemma's turn format, for GGUF files of the Gemma family that carry no chat template. Gemma has no
# system role: a leading system message opens the first turn, followed by a blank line (alone, it
# is a user turn). "assistant" turns are the "model" role. Content is a string or a list of text
# parts. The text starts with <bos>, which encode() then finds in place and does not add again.
GEMMA_CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is not none -%}{%- for part in content -%}"
    "{%- if part.type != 'text' -%}{{ raise_exception('only text content parts are supported') }}{%- endif -%}"
    "{{ part.text }}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- set ns = namespace(prefix='') -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message.role == 'system' -%}"
    "{%- set ns.prefix = text(message.content) + '\n\n' -%}"
    "{%- if loop.last -%}{{ '<start_of_turn>user\n' + text(message.content) + '<end_of_turn>\n' }}{%- endif -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if message.role == 'assistant' else message.role) + '\n' }}"
    "{{ ns.prefix + text(message.content) + '<end_of_turn>\n' }}"
    "{%- set ns.prefix = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@dataclass(slots=True)
class Tokenizer:
    backend: BackendTokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool = False
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... for templates
    _max_token_chars: int | None = field(default=None, repr=False)

    # ---- construction ----

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise ValueError(f"{path} has no tokenizer.json (Conveyor needs the fast-tokenizer file)")
        backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        special = {name: _token_content(config.get(name))
                   for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        special = {name: tok for name, tok in special.items() if tok is not None}
        bos_id = backend.token_to_id(special["bos_token"]) if "bos_token" in special else None
        eos_ids: list[int] = []
        if "eos_token" in special and (eos := backend.token_to_id(special["eos_token"])) is not None:
            eos_ids.append(eos)
        gen = _read_json(path / "generation_config.json")
        model_eos = gen.get("eos_token_id", _read_json(path / "config.json").get("eos_token_id"))
        eos_ids += [model_eos] if isinstance(model_eos, int) else list(model_eos or [])
        # A post-processor (e.g. Llama 3's TemplateProcessing) may add BOS without the config saying so.
        adds_bos = bos_id is not None and backend.encode("").ids[:1] == [bos_id]
        return cls(backend=backend, bos_token_id=bos_id, eos_token_ids=tuple(dict.fromkeys(eos_ids)),
                   add_bos_token=bool(config.get("add_bos_token", False)) or adds_bos,
                   chat_template=_hf_chat_template(path, config), special_tokens=special)

    @classmethod
    def from_gguf(cls, source: str | Path | gguf.GGUFReader, pre: str | None = None) -> Tokenizer:
        """Rebuild the tokenizer described by a GGUF file's metadata (a path, or a reader already open).

        Supports byte-level BPE (`tokenizer.ggml.model` "gpt2") and SentencePiece BPE with scores
        ("llama": Llama 2, Mistral, Gemma). `pre` overrides `tokenizer.ggml.pre` (byte-level BPE
        only); "default" reproduces transformers' GGUF loader, which ignores the pre-tokenizer type
        for smollm (it does not isolate digits, unlike llama.cpp and the model's own tokenizer.json).
        """
        meta = _read_gguf_metadata(source)
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type", [])
        ids = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in (
            ("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
        special = {name: tokens[i] for name, i in ids.items() if i is not None and 0 <= i < len(tokens)}
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges", []),
                                      pre or meta.get("tokenizer.ggml.pre", "default"))
            _add_gguf_special_tokens(backend, tokens, types, normalized=False)
        elif kind == "llama":
            if "tokenizer.ggml.scores" not in meta:
                raise ValueError("GGUF SentencePiece tokenizer without tokenizer.ggml.scores")
            add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
            backend = _sentencepiece_bpe(tokens, meta["tokenizer.ggml.scores"], types,
                                         special.get("unk_token", "<unk>"), add_space_prefix)
            # SentencePiece cuts its user-defined pieces out of the normalized text (spaces already
            # "\u2581"), longest first, and never merges them. Gemma's pieces for runs of 2-31 spaces
            # are stored with real spaces; matched in the normalized text they also take a "\u2581"
            # written in the text, as SentencePiece does. The normalizer rewrites the pieces too,
            # which a prefix space would spoil: with one, they match the raw text (as in llama.cpp).
            _add_gguf_special_tokens(backend, tokens, types, normalized=not add_space_prefix)
        else:
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2' "
                             "and SentencePiece BPE 'llama'); use Tokenizer.from_hf_dir with the model's "
                             "tokenizer.json instead")
        eos_ids = [meta.get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
        eos_ids += [i for t in _END_OF_TURN_TOKENS
                    if (i := backend.token_to_id(t)) is not None and i < len(types) and types[i] == _CONTROL]
        chat_template = meta.get("tokenizer.chat_template")
        if chat_template is None and str(meta.get("general.architecture", "")).startswith("gemma"):
            chat_template = GEMMA_CHAT_TEMPLATE
        return cls(backend=backend, bos_token_id=ids["bos_token"],
                   eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
                   add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                   chat_template=chat_template, special_tokens=special)

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and generation_config.json (eos ids),
        which ``from_hf_dir`` reads back into an identical tokenizer."""
        directory = Path(directory)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {**self.special_tokens, "add_bos_token": self.add_bos_token}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        gen = _read_json(directory / "generation_config.json")
        gen["eos_token_id"] = list(self.eos_token_ids)
        (directory / "generation_config.json").write_text(json.dumps(gen, indent=1))

    # ---- encode / decode ----

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; ValueError if it is not valid Unicode (a lone UTF-16 surrogate).

        Long texts go through encode_batch, which releases the GIL while it works, so that other
        threads (the server's event loop, the engine) keep running.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        try:
            if len(text) > _NOGIL_CHARS:
                ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            else:
                ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:   # the Rust side cannot take str with surrogates
            raise ValueError(invalid_text_message(text)) from None
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None \
                and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    @property
    def max_token_chars(self) -> int:
        """The longest token's text: a text of c characters has at least c / this many tokens."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    def id_to_token_str(self, token_id: int) -> str:
        """The text of one token on its own (a partial UTF-8 character shows as U+FFFD)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    # ---- chat ----

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: list[dict] | None = None,
                            chat_template: str | None = None, continue_final_message: bool = False,
                            **kwargs: Any) -> str | list[int]:
        """`chat_template` replaces the model's; `continue_final_message` ends the text right after the
        last message's content (no end-of-turn), so the model continues that message."""
        source = chat_template or self.chat_template
        if not source:
            raise ValueError("this model has no chat template; pass a prompt instead of messages")
        template = _compile_template(source)
        variables = {**self.special_tokens, **kwargs}
        text = template.render(messages=messages, tools=tools,
                               add_generation_prompt=add_generation_prompt, **variables)
        if continue_final_message:
            final = messages[-1].get("content") or "" if messages else ""
            cut = text.rfind(final) if final else -1
            if cut < 0:
                raise ValueError("continue_final_message: the final message's content is not in the rendered text")
            text = text[:cut + len(final)]
        return self.encode(text, add_special_tokens=False) if tokenize else text


# Texts longer than this are encoded without holding the GIL.
_NOGIL_CHARS = 20_000


def invalid_text_message(text: str) -> str:
    """Why `text` cannot be encoded as UTF-8 (it holds a lone UTF-16 surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"the text is not valid Unicode: a lone surrogate {text[e.start]!r} at character {e.start} "
                "(a JSON string may only hold \\ud800-\\udfff escapes as surrogate pairs)")
    return "the text could not be tokenized"


# ---- incremental detokenization ----

class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a UTF-8 character.

    Decodes only a window: ids[prefix_offset:read_offset] were already emitted and give the
    context that some decoders need (e.g. a leading-space strip); the text past them is new.
    Text ending in U+FFFD is held back, since more bytes may complete the character.
    """

    # More pending tokens than this and the held-back U+FFFDs are final (a character has at most
    # 4 bytes), so the window is forced forward to keep each step O(window).
    _MAX_PENDING = 8

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_len = 0    # len(decode(ids[prefix_offset:read_offset]))
        self._emitted = 0       # chars emitted past the read offset (held-back text excluded)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        full = self._decode(self._prefix_offset)
        new = full[self._prefix_len:]
        stable = new.rstrip(REPLACEMENT_CHAR)
        delta = self._emit(stable)
        if stable == new:
            self._advance(len(self.token_ids))
        elif len(self.token_ids) - self._read_offset > self._MAX_PENDING:
            delta += self._force_advance(full)
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character at the end shows as U+FFFD)."""
        delta = self._emit(self._decode(self._prefix_offset)[self._prefix_len:])
        self._advance(len(self.token_ids))
        return delta

    def _emit(self, new: str) -> str:
        delta = new[self._emitted:]
        self._emitted += len(delta)
        self.text += delta
        return delta

    def _advance(self, read_offset: int) -> None:
        self._prefix_offset, self._read_offset = self._read_offset, read_offset
        self._prefix_len = len(self._decode(self._prefix_offset, self._read_offset))
        self._emitted = 0

    def _force_advance(self, full: str) -> str:
        # At least 3 bytes after `end` settle any incomplete sequence that ends ids[:end]; if the
        # text up to `end` is still a prefix of `full`, it is final and the window can move there.
        end = len(self.token_ids) - 3
        while end > self._read_offset and len(self._decode(end)) < 3:
            end -= 1
        if end <= self._read_offset:
            return ""
        head = self._decode(self._prefix_offset, end)
        if len(head) < self._prefix_len or not full.startswith(head):
            return ""
        new_prefix_len = len(self._decode(self._read_offset, end))
        if self._decode(self._read_offset)[new_prefix_len:] != full[len(head):]:
            return ""
        delta = self._emit(head[self._prefix_len:])
        emitted_past_end = self._prefix_len + self._emitted - len(head)
        self._prefix_offset, self._read_offset = self._read_offset, end
        self._prefix_len, self._emitted = new_prefix_len, emitted_past_end
        return delta


# ---- helpers ----

def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(token: str | dict | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None and (path / "chat_template.json").is_file():   # a multimodal processor's (Gemma 3 4B+)
        template = json.loads((path / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):  # named templates
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


def _read_gguf_metadata(source: str | Path | gguf.GGUFReader) -> dict[str, Any]:
    import gguf   # lazy: keeps numpy (gguf) out of the torch-free units

    reader = source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(str(source))
    return {key: f.contents() for key, f in reader.fields.items()
            if key.startswith(("tokenizer.", "general.architecture"))}


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> BackendTokenizer:
    if pre not in _GGUF_PRE:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; known: {sorted(_GGUF_PRE)}")
    splits, ignore_merges = _GGUF_PRE[pre]
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    pairs = [tuple(m.split(" ")) for m in merges]
    assert all(len(p) == 2 for p in pairs), "a GGUF merge must be two space-separated tokens"
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], unk_token: str,
                       add_space_prefix: bool) -> BackendTokenizer:
    """SentencePiece BPE (GGUF "llama"): spaces become "\u2581", then the text between added tokens
    is merged as one word, unknown characters falling back to <0xNN> byte tokens."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=_merges_from_scores(tokens, scores, types),
                                          unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    replace = normalizers.Replace(" ", "\u2581")
    # llama.cpp prepends the space to each stretch of text after the start or a special token, as
    # the normalizer (run on each stretch between added tokens) does here.
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if add_space_prefix \
        else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if add_space_prefix else steps)
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, best first.

    SentencePiece (and llama.cpp) repeatedly joins the adjacent pair of pieces whose concatenation
    is the token with the highest score, the leftmost pair on a tie. As ranked merges: (l, r) for
    every normal token l + r whose pieces l and r are tokens too, ordered by that token's score,
    higher first; equal scores keep file order. A token made by several splits gets one merge per
    split, longest left piece first (transformers' order). Ranks cannot give those splits SentencePiece's
    one priority, but the choice only matters where two of them overlap in a word; on Gemma 3's
    vocabulary either order gave SentencePiece's own result on every word tried. Only normal tokens
    are merge results: control and user-defined tokens are matched whole before BPE runs, and byte
    tokens only come from byte fallback (text spelling "<0x41>" must not turn into the byte "A").
    """
    known = set(tokens)
    merges: list[tuple[str, str]] = []
    for i in sorted(range(len(tokens)), key=lambda i: (-scores[i], i)):
        if types and types[i] != _NORMAL:
            continue
        tok = tokens[i]
        merges += [(tok[:k], tok[k:]) for k in range(len(tok) - 1, 0, -1)
                   if tok[:k] in known and tok[k:] in known]
    return merges


def _add_gguf_special_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int],
                             normalized: bool) -> None:
    """Control and unknown tokens as special tokens, user-defined ones as plain added tokens (matched
    in the normalized text if `normalized`): like llama.cpp, which splits all of these out of the text
    before BPE. Contents already in the vocabulary keep their ids; they are only matched whole."""
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty in (_CONTROL, _UNKNOWN)])
    backend.add_tokens([AddedToken(t, special=False, normalized=normalized)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers in HF templates): renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters and non-ASCII; chat templates want plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
