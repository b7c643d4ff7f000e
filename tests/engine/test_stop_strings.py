"""Stop strings: the incremental automaton against brute force, and the output processor around it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.core.engine_core import SeqUpdate
from conveyor.frontend.output_processor import OutputProcessor
from conveyor.frontend.stop_strings import StopAutomaton, StopScanner, compile_stops
from conveyor.request import RequestMetrics, RequestStatus
from conveyor.sampling.params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Brute force: the match that completes first (the longest of those ending there)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def longest_pending(text: str, stops: list[str]) -> int:
    """Brute force: the longest suffix of text that is a proper prefix of some stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab c", max_size=30),
       stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=5), min_size=1, max_size=4),
       chunks=st.lists(st.integers(1, 4), max_size=30))
def test_scanner_matches_brute_force_whatever_the_chunking(text, stops, chunks):
    scanner, pos = StopScanner(stops), 0
    want = first_stop(text, stops)
    for n in chunks + [len(text)]:
        piece = text[pos:pos + n]
        hit = scanner.feed(piece)
        if hit is not None:
            assert want is not None and (pos + hit[0], hit[1]) == want
            return
        pos += len(piece)
        assert want is None or want[0] > pos
        assert scanner.held == longest_pending(text[:pos], stops)
        if pos == len(text):
            break
    assert want is None


def test_each_character_is_consumed_once(monkeypatch):
    """The scan is incremental: a step's cost is its new characters, not the text so far."""
    automaton = compile_stops(tuple(f"stop{i}-" + "x" * 200 for i in range(MAX_STOP_STRINGS)))
    calls = 0
    advance = StopAutomaton.advance

    def counting(self, state, ch):
        nonlocal calls
        calls += 1
        return advance(self, state, ch)

    monkeypatch.setattr(StopAutomaton, "advance", counting)
    scanner = StopScanner(automaton.stops)
    text = "stop1-xxxx and some other words " * 100
    for i in range(0, len(text), 7):
        assert scanner.feed(text[i:i + 7]) is None
    assert calls == len(text)


def test_limits_on_stop_strings():
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS)
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS} strings"):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRING_CHARS} characters"):
        SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)])


# ---- the output processor ---------------------------------------------------------------------

def _run(tok, text: str, params: SamplingParams, finish_with_last: str | None = None):
    """Feed text's tokens one per step through an OutputProcessor; returns (outputs, commands)."""
    op = OutputProcessor(tok)
    metrics = RequestMetrics(0.0)
    op.add("r", None, [1], params, ["s"], 0.0)
    ids = tok.encode(text, add_special_tokens=False)
    outs, cmds = [], []
    for k, t in enumerate(ids):
        last = k == len(ids) - 1
        o, c = op.process([SeqUpdate("s", t, None, finish_with_last if last else None, None, None, metrics)])
        outs += o
        cmds += c
        if c:
            break
    return outs, cmds


def test_stop_string_spanning_tokens_is_held_back_then_cut(demo_tokenizer):
    text = "The answer is 42. STOP here and more"
    outs, cmds = _run(demo_tokenizer, text, SamplingParams(stop=["STOP here", "\n\n"]))
    assert [(c.seq_ids, c.status, c.reason) for c in cmds] == [(["s"], RequestStatus.FINISHED_STOPPED, "STOP here")]
    final = outs[-1].outputs[0]
    assert outs[-1].finished and final.finish_reason == "stop" and final.stop_reason == "STOP here"
    assert final.text == "The answer is 42. "
    assert "".join(o.outputs[0].delta_text for o in outs) == final.text
    for o in outs[:-1]:   # while running, nothing of a possible stop string was shown
        assert "The answer is 42. ".startswith(o.outputs[0].text) and "S" not in o.outputs[0].text


def test_include_stop_str_in_output(demo_tokenizer):
    outs, _ = _run(demo_tokenizer, "one two three four", SamplingParams(stop=["three"], include_stop_str_in_output=True))
    assert outs[-1].outputs[0].text == "one two three"


def test_stop_string_wins_over_a_length_finish_in_the_same_token(demo_tokenizer):
    outs, cmds = _run(demo_tokenizer, "alpha beta", SamplingParams(stop=["beta"]), finish_with_last="length")
    assert cmds == []   # already finished: nothing for the core to do
    c = outs[-1].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "beta" and c.text == "alpha "
