"""How the router cuts decode's event stream into events, wherever its reads end."""

from __future__ import annotations

import json

from kvtransfer.serve.openai_api import sse
from kvtransfer.serve.router import _whole_events


def _stream() -> str:
    chunks = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("a", " b\n\nc", "é", "")]
    chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "kvtransfer": {"kv_bytes": 1}})
    return b"".join(sse(c) for c in chunks).decode() + sse("[DONE]").decode()


def _cut(text: str, at) -> list:
    """Every event's data, the stream read in the pieces that end at ``at``."""
    out, tail, last = [], "", 0
    for end in [*at, len(text)]:
        datas, tail = _whole_events(tail, text[last:end])
        out += datas
        last = end
    assert tail == ""
    return out


def test_events_are_whole_wherever_the_reads_end():
    text = _stream()
    whole = _cut(text, [])
    assert whole[-1] == "[DONE]" and [json.loads(d) for d in whole[:-1]][1]["choices"][0]["text"] == " b\n\nc"
    for cut in range(1, len(text)):  # one cut anywhere, then a read of every character
        assert _cut(text, [cut]) == whole
    assert _cut(text, range(1, len(text))) == whole
