"""The OpenAI wire format as the client reads and writes it (kvbench.remote.wire), on hand-written events in the
shapes vLLM, SGLang and OpenAI send, and the model node's checks before anything is sent (kvbench.remote.spec)."""
from __future__ import annotations

import pytest

from kvbench.remote.client import Timed, closed_loop
from kvbench.remote.spec import RemoteSpec
from kvbench.engine.generation import Sampling
from kvbench.remote.wire import Reply, ServerError, completion_body, sse_data


def test_a_stream_reads_to_its_text_finish_reason_usage_and_extra_objects():
    lines = [": keep-alive comment", "",
             'data: {"id":"c1","object":"text_completion","choices":[{"index":0,"text":" to","finish_reason":null}]}',
             "event: ignored", 'data: {"choices":[{"index":0,"text":"","finish_reason":null}]}',  # an empty piece
             'data: {"choices":[{"index":0,"text":" eat","finish_reason":"stop","kvbench":{"kv_bytes":512}}]}',
             'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14},'
             '"stats":{"running":2}}',
             "data: [DONE]"]
    reply, texted = Reply(), []
    for line in lines:
        data = sse_data(line)
        if data == "[DONE]":
            break
        if data is not None:
            texted.append(reply.take(data))
    assert texted == [True, False, True, False]  # the first True is the first token's chunk
    assert reply.text == " to eat" and reply.finish_reason == "stop"
    assert reply.usage == {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}
    assert reply.extra == {"kvbench": {"kv_bytes": 512}, "stats": {"running": 2}}  # in a choice, or at the top


def test_chat_deltas_are_read_and_an_error_event_raises():
    reply = Reply()
    assert reply.take({"choices": [{"delta": {"role": "assistant"}}]}) is False
    assert reply.take({"choices": [{"delta": {"content": "Hi"}, "finish_reason": "length"}]}) is True
    assert reply.text == "Hi" and reply.finish_reason == "length"
    with pytest.raises(ServerError, match="prompt too long"):
        reply.take({"error": {"message": "prompt too long", "code": 400}})
    with pytest.raises(ServerError, match="not a JSON event"):
        sse_data("data: {broken")


def test_a_body_is_greedy_by_default_and_sends_extra_fields_only_when_they_change_something():
    plain = completion_body("m", [1, 2, 3], 30)
    assert plain == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 30, "stream": True,
                     "stream_options": {"include_usage": True}, "temperature": 0.0}
    sampled = completion_body("m", "text", 8, stop=("\n",), stop_token_ids=(7,), min_tokens=2,
                              sampling=Sampling(True, 0.7, top_k=50, top_p=0.9), seed=3)
    assert sampled["prompt"] == "text" and sampled["temperature"] == 0.7 and sampled["top_p"] == 0.9
    assert (sampled["top_k"], sampled["seed"], sampled["stop"], sampled["stop_token_ids"], sampled["min_tokens"]) \
        == (50, 3, ["\n"], [7], 2)
    assert "seed" not in completion_body("m", "t", 1, seed=3)  # greedy: a seed changes nothing


def test_timings_per_output_token_come_from_usage_or_chunks():
    timed = Timed("abc", "stop", {"completion_tokens": 5}, {}, 0.0, ttft_s=1.0, e2e_s=3.0, chunks=3)
    assert timed.tokens == 5 and timed.tpot_s == pytest.approx(0.5)  # (3 - 1) / (5 - 1)
    no_usage = Timed("abc", "stop", None, {}, 0.0, ttft_s=1.0, e2e_s=2.0, chunks=3)
    assert no_usage.tokens == 3 and no_usage.tpot_s == pytest.approx(0.5)
    assert Timed("a", "length", {"completion_tokens": 1}, {}, 0.0, 1.0, 1.0, 1).tpot_s is None
    assert closed_loop(5, 2) == [0.0, 0.0, None, None, None]


@pytest.mark.parametrize("fields, says", [
    ({"base_url": "localhost:8000"}, "is not an http(s) URL"),
    ({"send": "tokens"}, "send='tokens' is not one of ids, text"),
    ({"name": "org/model"}, "must be a plain name"),
])
def test_a_bad_model_node_is_one_line(fields, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        RemoteSpec(**{"name": "m", "base_url": "http://localhost:8000/v1", **fields})
    assert RemoteSpec(name="m", base_url="http://h:1/v1", served="org/model").model_name == "org/model"
