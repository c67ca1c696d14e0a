"""The OpenAI-compatible server (`python -m kvbench.serve`), started as a real process on localhost and spoken to over
HTTP: concurrent requests answered with the engine's own greedy generations, streamed chunks that join into the
reply, a client that leaves mid-stream (its row and bytes freed), malformed and oversized requests (400, and the
server goes on), and SIGTERM with requests in flight (each gets its answer or a clean error; exit status 0). Also,
in-process, the engine's cancellation hook: a cancelled sample leaves the batch at its next step and frees its rows.

One server serves the module (the SIGTERM test stops it: it runs last). No wait is against a clock
(tests/unit/test_no_deadlines.py): each is for a state the server reports or a process to end, and HTTP calls have
no timeout; a real hang is the CI job's limit to catch."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from kvbench.engine.generation import Sampling
from kvbench.runs.api import Engine, RunSpec
from kvbench.serving.serve_spec import ServeSpec, check_port, parse
from kvbench.serving.wire import TextStream

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
RUN = ("model=tiny_llama", "method=snapkv", "budget=48", "method.window=8")
MAX_BATCH, POOL_BYTES, MAX_PROMPT, MAX_TOKENS = 4, 12_000_000, 256, 30_000
ENTRY = 512  # tiny_llama: 2 layers x 2 KV heads x head_dim 16 x fp32, keys and values
LONG = 20_000  # new tokens no client waits for: (1 + LONG) x 512 bytes fit the pool once


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """The server process, its base URL and log."""

    def __init__(self, log: Path):
        self.port, self.log = free_port(), log
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        args = [sys.executable, "-m", "kvbench.serve", *RUN, f"serve.port={self.port}", f"serve.max_batch={MAX_BATCH}",
                f"serve.pool_bytes={POOL_BYTES}", f"serve.max_prompt_tokens={MAX_PROMPT}",
                f"serve.max_tokens={MAX_TOKENS}", "serve.grace_s=1"]
        self.out = log.open("w")
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self.out, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        """Until /health answers 200 (or the process has exited: its log is the failure)."""
        while True:
            assert self.proc.poll() is None, f"the server exited ({self.proc.returncode}):\n{self.log.read_text()}"
            try:
                if get(self, "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def stats(self) -> dict:
        return get(self, "/kvbench/stats").json()

    def until(self, condition) -> dict:
        """The stats once `condition(stats)` holds."""
        while not condition(stats := self.stats()):
            time.sleep(0.05)
        return stats

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait()
        self.out.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server process, and the same run in this process (built while the server starts)."""
    server = Served(tmp_path_factory.mktemp("serve") / "server.log")
    try:
        spec = RunSpec(method="snapkv", budget=48, model="tiny_llama", batch_size=MAX_BATCH,
                       overrides=("method.window=8",))
        with Engine(spec) as engine:
            server.wait_ready()
            yield server, engine
    finally:
        server.stop()


def get(server: Served, path: str) -> httpx.Response:
    return httpx.get(f"{server.url}{path}", timeout=None)


def post(server: Served, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=None)


def streamed(server: Served, path: str, body: dict):
    return httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=None)


def events(lines) -> list:
    """The `data:` payloads of a server-sent event stream: dicts, and "[DONE]"."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


PROMPTS = ["The pass key is 71432. Remember it.", "hello world", [5, 17, 300, 4000, 2222, 99], "Once upon a time"]


def test_concurrent_requests_are_answered_with_the_engines_greedy_generations(served):
    server, engine = served
    expected = engine.generate(PROMPTS, max_new_tokens=12)
    replies: dict[int, httpx.Response] = {}

    def ask(i: int) -> None:
        replies[i] = post(server, "/v1/completions", {"model": "tiny-llama", "prompt": PROMPTS[i], "max_tokens": 12})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, gen in enumerate(expected):
        body = replies[i].json()
        assert replies[i].status_code == 200, body
        (choice,) = body["choices"]
        assert choice["text"] == gen.text
        assert body["usage"]["completion_tokens"] == len(gen.token_ids)
        assert body["usage"]["prompt_tokens"] == len(engine.encode(PROMPTS[i]))
        assert choice["finish_reason"] == {"max_new_tokens": "length", "eos": "stop"}[gen.stop_reason]
        assert (choice["kvbench"]["kv_bytes"], choice["kvbench"]["full_kv_bytes"]) == (gen.kv_bytes, gen.full_kv_bytes)
        n = len(engine.encode(PROMPTS[i]))  # the reservation, by hand: the kept prompt and every new token
        assert choice["kvbench"]["reserved_bytes"] == (min(n, 48) + 12) * ENTRY
    # a list of prompts is one request with a choice each, in order
    body = post(server, "/v1/completions", {"prompt": PROMPTS[:2], "max_tokens": 12}).json()
    assert [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])] == [g.text for g in expected[:2]]
    assert server.stats()["pool"]["used_bytes"] == 0


def test_streamed_chunks_join_into_the_reply_and_stop_strings_cut_both(served):
    server, _ = served
    ask = {"prompt": "hello world", "max_tokens": 12}
    whole = post(server, "/v1/completions", ask).json()["choices"][0]["text"]
    with streamed(server, "/v1/completions", {**ask, "stream_options": {"include_usage": True}}) as r:
        got = events(r.iter_lines())
    assert got[-1] == "[DONE]" and got[-2]["usage"]["completion_tokens"] == 12 and got[-2]["choices"] == []
    pieces = [c["choices"][0] for c in got[:-2]]
    assert "".join(p["text"] for p in pieces) == whole and len(pieces) > 2
    assert [p["finish_reason"] for p in pieces][-1] == "length" and "kvbench" in pieces[-1]
    # a stop string from the second half of the reply (not at its start): both cut it at its first occurrence
    stop = next(whole[i:i + 3] for i in range(len(whole) // 2, len(whole) - 3) if whole.find(whole[i:i + 3]) > 0)
    cut = whole[:whole.find(stop)]
    stopped = post(server, "/v1/completions", {**ask, "stop": [stop]}).json()["choices"][0]
    assert (stopped["text"], stopped["finish_reason"]) == (cut, "stop")
    with streamed(server, "/v1/completions", {**ask, "stop": stop}) as r:
        got = events(r.iter_lines())
    assert "".join(c["choices"][0]["text"] for c in got[:-1]) == cut
    # chat: a role first, then content that joins into the non-streamed message
    chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
    message = post(server, "/v1/chat/completions", chat).json()["choices"][0]["message"]
    with streamed(server, "/v1/chat/completions", chat) as r:
        got = events(r.iter_lines())
    deltas = [c["choices"][0]["delta"] for c in got[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""} and got[-1] == "[DONE]"
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    assert got[-2]["object"] == "chat.completion.chunk" and got[-2]["choices"][0]["finish_reason"] == "length"


def test_a_sampled_request_is_the_engines_sample_with_the_same_seed(served):
    server, engine = served
    ask = {"prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0.8, "top_p": 0.9, "seed": 5}
    texts = [post(server, "/v1/completions", ask).json()["choices"][0]["text"] for _ in range(2)]
    request = engine.request(PROMPTS[0], 10)
    request.decoding = dataclasses.replace(engine.run.decoding(), sampling=Sampling(True, 0.8, 0, 0.9, 5))
    ((_, gen),) = engine.decoder(1).run([request])
    assert texts == [gen.text, gen.text]
    greedy = engine.generate(PROMPTS[:1], max_new_tokens=10)[0]
    assert gen.token_ids != greedy.token_ids  # (sampled at 0.8 from a random model: not its argmax path)


def test_a_client_that_leaves_mid_stream_frees_its_row_and_bytes(served):
    server, _ = served
    before = server.stats()["requests"]["cancelled"]
    with streamed(server, "/v1/completions", {"prompt": [7], "max_tokens": LONG, "ignore_eos": True}) as r:
        lines = r.iter_lines()  # (held: closing it would close the connection)
        next(line for line in lines if line.startswith("data: "))  # one token in: it runs, holding its bytes
        running = server.stats()
        assert running["running"] == 1 and running["pool"]["used_bytes"] == (1 + LONG) * ENTRY
    stats = server.until(lambda s: s["requests"]["cancelled"] == before + 1)
    stats = server.until(lambda s: s["running"] == 0)
    assert stats["pool"]["used_bytes"] == 0 and stats["waiting"] == 0
    # a client that leaves a non-streamed request is noticed too: its connection closed while the request runs
    body = json.dumps({"prompt": "hi", "max_tokens": LONG, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        server.until(lambda s: s["running"] == 1)
    stats = server.until(lambda s: s["requests"]["cancelled"] == before + 2 and s["running"] == 0)
    assert stats["pool"]["used_bytes"] == 0
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3}).status_code == 200


@pytest.mark.parametrize("body, where", [
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "temperature": 5}, "temperature"),
    ({"prompt": "hi", "top_p": 0.5}, "temperature"),  # greedy server: top_p alone cannot be honoured
    ({"prompt": "hi", "logprobs": 1, "echo": True}, "logprobs"),
    ({"prompt": [], "max_tokens": 3}, "prompt"),
    ({"prompt": ["hi", [1, 2]], "max_tokens": 3}, "prompt"),  # text and ids mixed
    ({"prompt": [10 ** 9], "max_tokens": 3}, "prompt"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
])
def test_a_malformed_request_gets_400_and_the_server_goes_on(served, body, where):
    server, _ = served
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith(where) and error["message"]
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_bad_json_an_unknown_model_and_a_chat_without_messages(served):
    server, _ = served
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"},
                   timeout=None)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert r.status_code == 404 and "'tiny-llama'" in r.json()["error"]["message"]
    assert post(server, "/v1/chat/completions", {"messages": []}).status_code == 400
    models = get(server, "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]


def test_the_tokenizer_endpoints_lm_evals_remote_tokenizer_reads(served):
    server, engine = served
    ids = post(server, "/tokenize", {"prompt": "The pass key is 71432."}).json()["tokens"]
    assert ids == engine.tokenizer("The pass key is 71432.").input_ids
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == "The pass key is 71432."
    messages = [{"role": "user", "content": "Say hi."}]
    rendered = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert post(server, "/tokenize", {"messages": messages}).json()["tokens"] == \
        engine.tokenizer(rendered, add_special_tokens=False).input_ids
    info = get(server, "/tokenizer_info").json()
    assert (info["eos_token"], info["chat_template"]) == (engine.tokenizer.eos_token, engine.tokenizer.chat_template)


def test_an_oversized_prompt_or_reservation_gets_a_clear_400(served):
    server, _ = served
    r = post(server, "/v1/completions", {"prompt": list(range(10, 10 + MAX_PROMPT + 1)), "max_tokens": 4})
    assert r.status_code == 400 and f"{MAX_PROMPT + 1} tokens" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": MAX_TOKENS + 1})
    assert r.status_code == 400 and "serve.max_tokens" in r.json()["error"]["message"]
    too_many = POOL_BYTES // ENTRY  # (1 + too_many) entries of 512 bytes are more than the whole pool
    r = post(server, "/v1/completions", {"prompt": [7], "max_tokens": too_many})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and f"({(1 + too_many) * ENTRY} bytes" in message and str(POOL_BYTES) in message
    assert server.stats()["pool"]["used_bytes"] == 0


def test_command_line_refusals_come_before_weights_load():
    with pytest.raises(ValueError, match="no setting 'prot'; valid: .*port"):
        parse(["serve.prot=1"])
    with pytest.raises(ValueError, match="serve.max_batch"):
        parse(["batch_size=4"])
    with pytest.raises(ValueError, match="port=70000 must be in 1..65535"):
        parse(["serve.port=70000"])
    with pytest.raises(ValueError, match="port='80.5' must be an integer"):
        parse(["serve.port=80.5"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{taken.getsockname()[1]}"):
            check_port("127.0.0.1", taken.getsockname()[1])
    spec, serve = parse([*RUN, "serve.max_batch=3", "serve.pool_bytes=1000000", "serve.grace_s=2",
                         "serve.host=0.0.0.0", "serve.max_prompt_tokens=null"])
    assert (spec.method, spec.budget, spec.batch_size, spec.overrides) == ("snapkv", 48, 3, ("method.window=8",))
    assert serve == ServeSpec(max_batch=3, pool_bytes=1_000_000, grace_s=2.0, host="0.0.0.0")


def test_streamed_text_holds_back_what_may_still_change(served):
    """Token by token: an unfinished UTF-8 character and the start of a stop string are held back; a stop string
    cuts the text where the engine cuts it; `final` sends the rest of the finished reply."""
    tokenizer = served[1].tokenizer
    text = "Hello there, général Kenobi 🙂"
    ids = tokenizer(text).input_ids

    def streamed(stops: tuple[str, ...], final: str) -> tuple[list[str], str]:
        stream = TextStream(tokenizer, stops)
        pieces = [stream.push([t]) for t in ids]
        return pieces, "".join(pieces) + stream.final(final)

    pieces, joined = streamed((), text)
    assert joined == text and not any("\ufffd" in p for p in pieces)
    pieces, joined = streamed(("général",), "Hello there, ")  # the engine's text, cut before the stop string
    assert joined == "Hello there, " and "".join(pieces) == "Hello there, "
    pieces, joined = streamed(("Kenobi 🙂?",), text)  # its start is held back until the reply ends without it
    assert "".join(pieces) == "Hello there, général " and joined == text


def test_the_engine_drops_a_cancelled_sample_at_its_next_step_and_frees_its_rows(served):
    _, engine = served
    alone = engine.generate(PROMPTS[:2], max_new_tokens=10)
    a, b = (engine.request(p, 10) for p in PROMPTS[:2])
    decoder = engine.decoder(2)
    owners = []  # rows held after each step

    def step(active) -> None:
        owners.append(sum(o is not None for rows in decoder.rows.values() for o in rows.owners))
        for slot in active:
            if slot.request is a and len(slot.tokens) == 3:
                a.cancelled = True  # (as the server's handler thread does)

    decoder.on_step = step
    out = dict(decoder.run([a, b]))
    assert out[a].stop_reason == "cancelled" and out[a].token_ids == alone[0].token_ids[:3]
    assert out[b].token_ids == alone[1].token_ids and out[b].stop_reason == alone[1].stop_reason
    layers = len(engine.model.model.layers)
    assert owners[0] == 2 * layers and owners[-1] == layers  # both samples' rows, then b's alone


def test_sigterm_with_requests_in_flight_answers_them_and_exits_0(served):
    """Last: it stops the module's server."""
    server, _ = served
    results: dict = {}

    def long_stream() -> None:
        with streamed(server, "/v1/completions", {"prompt": "hello", "max_tokens": LONG, "ignore_eos": True}) as r:
            results["streamed"] = events(r.iter_lines())

    def whole() -> None:
        results["whole"] = post(server, "/v1/completions", {"prompt": "hi there", "max_tokens": 40})

    done_before = server.stats()["requests"]["finished"]
    threads = [threading.Thread(target=f) for f in (long_stream, whole)]
    for t in threads:
        t.start()
    # both taken (the short one may have finished already: its answer is whole then)
    server.until(lambda s: s["running"] + s["waiting"] + s["requests"]["finished"] - done_before == 2)
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join()  # (a client that hangs after SIGTERM hangs here)
    assert server.proc.wait() == 0, server.log.read_text()
    stream = results["streamed"]
    assert stream[-1] == "[DONE]"  # its full answer, or a clean error event (after serve.grace_s)
    last = stream[-2]
    assert last.get("error", {}).get("code") == "shutdown" or last["choices"][0]["finish_reason"] == "length"
    reply = results["whole"]
    assert (reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 40) or \
        (reply.status_code == 503 and reply.json()["error"]["code"] == "shutdown")
