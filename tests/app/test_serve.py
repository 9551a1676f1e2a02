"""`duet serve` through the real `openai` client (and httpx where the client hides the wire): the text
equals `duet --headless` with the same seed and settings, stats come with every final response, a
client that leaves mid-stream frees the engine, bad requests get 400 and a JSON error, a key guards
every endpoint, requests keep their order under concurrent clients, and Ctrl-C stops the server."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from duet.app.cli import EXIT_INTERRUPTED, main
from duet.app.serve import EngineQueue, ServeSettings, StopScan, bind, build_app, make_server
from duet.app.session import EngineChoices
from duet.app.settings import Config
from duet.engine import Accept, Route, load_model

DEMO_INT4 = Path(__file__).resolve().parents[2] / "models" / "demo_int4"
KEY = "sk-test-not-a-secret"
SAMPLED = ["--temperature", "0.7", "--top-k", "20", "--top-p", "0.95", "--seed", "5", "--max-tokens", "40"]


class Running:
    """A server on 127.0.0.1 and a free port, in a thread, with its engine and its log lines."""

    def __init__(self, model: Path, budget: int | None = None, api_key: str | None = None):
        self.lines: list[str] = []
        lm = load_model(model)
        self.engine = EngineQueue(lm, self.lines.append)
        settings = ServeSettings(Config(), EngineChoices(), Accept.EXACT, Route(lm.route),
                                 budget or lm.config.max_position_embeddings)
        self.server = make_server(build_app(self.engine, settings, api_key), self.engine)
        listener = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [listener]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        self.client = openai.OpenAI(base_url=self.url, api_key=api_key or "unused", max_retries=0, timeout=120)

    def stop(self) -> None:
        self.server.should_exit = True
        self.engine.stop()
        self.thread.join(30)


@pytest.fixture(scope="module")
def demo():
    running = Running(DEMO_INT4)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def endless(endless_model):
    """The tiny model that never stops by itself (but at its 4,096-token budget), behind a key."""
    running = Running(endless_model, api_key=KEY)
    yield running
    running.stop()


def wait_until(condition, failure: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.01)


def headless(capsys, *args: str) -> dict:
    assert main(["--headless", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_models_lists_the_loaded_model(demo):
    (model,) = demo.client.models.list().data
    assert model.id == "demo_int4" and model.model_extra["duet"]["routes"] == ["w4a16", "w4a8", "bf16"]


def test_chat_text_equals_headless_with_the_same_seed_and_settings(demo, capsys):
    expected = headless(capsys, "Tell me of the land", "--model", str(DEMO_INT4), *SAMPLED)
    request = dict(model="demo_int4", messages=[{"role": "user", "content": "Tell me of the land"}], max_tokens=40,
                   temperature=0.7, top_p=0.95, seed=5, extra_body={"top_k": 20})
    whole = demo.client.chat.completions.create(**request)
    assert whole.choices[0].message.content == expected["text"]
    assert whole.choices[0].finish_reason == {"stop": "stop", "length": "length"}[expected["finish_reason"]]
    assert whole.usage.completion_tokens == len(expected["tokens"])
    stats = whole.model_extra["duet"]["stats"]
    assert stats["generated_tokens"] == expected["stats"]["generated_tokens"] and stats["routes"] == ["w4a16"]
    assert stats["tokens_per_cycle"] > 1 and stats["drafted"] > 0 and "accept_by_position" in stats

    chunks = list(demo.client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["text"]
    last = chunks[-1]
    assert last.choices[0].finish_reason == whole.choices[0].finish_reason
    assert last.usage.completion_tokens == len(expected["tokens"])
    assert last.model_extra["duet"]["stats"]["generated_tokens"] == stats["generated_tokens"]


def test_completions_take_the_prompt_as_is_like_raw(demo, capsys):
    expected = headless(capsys, "And God said", "--raw", "--model", str(DEMO_INT4), "--max-tokens", "24")
    whole = demo.client.completions.create(model="demo_int4", prompt="And God said", max_tokens=24, temperature=0)
    assert whole.choices[0].text == expected["text"] and whole.model_extra["duet"]["finish_reason"] == expected["finish_reason"]
    streamed = demo.client.completions.create(model="demo_int4", prompt="And God said", max_tokens=24, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected["text"]


def test_duet_fields_choose_route_rule_and_drafts_for_one_request_only(demo):
    def stats(**duet) -> dict:
        reply = demo.client.chat.completions.create(
            model="demo_int4", messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0,
            extra_body={"duet": duet} if duet else None)
        return reply.model_extra["duet"]

    asked = stats(route="w4a8", accept="lossy", draft="ngram", depth=6)
    assert (asked["stats"]["routes"], asked["stats"]["rules"], asked["drafter"]) == (["w4a8"], ["lossy"], "ngram")
    plain = stats()
    assert (plain["stats"]["routes"], plain["stats"]["rules"], plain["drafter"]) == (["w4a16"], ["exact"], "mtp")


def test_a_request_that_carries_on_the_last_conversation_prefills_only_its_new_turn(demo):
    messages = [{"role": "user", "content": "Tell me of the land of Egypt"}]
    first = demo.client.chat.completions.create(model="demo_int4", messages=messages, max_tokens=16, temperature=0)
    assert "cached_tokens" not in first.model_extra["duet"]["stats"]
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "And then?"}]
    second = demo.client.chat.completions.create(model="demo_int4", messages=messages, max_tokens=16, temperature=0)
    held = first.usage.prompt_tokens + first.usage.completion_tokens - 1  # all but the reply's last token have rows
    assert second.model_extra["duet"]["stats"]["cached_tokens"] >= held
    again = demo.client.chat.completions.create(model="demo_int4", messages=messages, max_tokens=16, temperature=0)
    assert again.choices[0].message.content == second.choices[0].message.content  # asked again: from the turn's start
    assert 0 < again.model_extra["duet"]["stats"]["cached_tokens"] < again.usage.prompt_tokens


def test_stop_strings_end_the_text_before_the_first_one(demo, capsys):
    expected = headless(capsys, "And God said", "--raw", "--model", str(DEMO_INT4), "--max-tokens", "40")["text"]
    stop = expected[len(expected) // 3: len(expected) // 3 + 4]  # some text a few tokens in, across token edges
    want = expected[:expected.index(stop)]
    for stream in (False, True):
        reply = demo.client.completions.create(model="demo_int4", prompt="And God said", max_tokens=40, temperature=0,
                                               stop=[stop, "never in the text"], stream=stream)
        chunks = list(reply) if stream else [reply]
        assert "".join(c.choices[0].text for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("pieces,stops,expected", [
    (["Hello wor", "ld! Bye"], ["world"], ("Hello ", True)),
    (["ab", "c", "d"], ["cd"], ("ab", True)),  # held back while it may start a stop string
    (["a<", "|x"], ["<|end|>"], ("a<|x", False)),  # let through once it cannot
    (["xyz"], [], ("xyz", False)),
])
def test_stop_scan_holds_back_only_what_may_start_a_stop_string(pieces, stops, expected):
    scan, out, stopped = StopScan(tuple(stops)), "", False
    for piece in pieces:
        text, stopped = scan.feed(piece)
        out += text
        if stopped:
            break
    if not stopped:
        out += scan.flush()
    assert (out, stopped) == expected


@pytest.mark.parametrize("body,param,words", [
    ({"temperature": "hot"}, "temperature", "temperature must be a number"),
    ({"max_tokens": 2.5}, "max_tokens", "max_tokens must be a whole number"),
    ({"max_tokens": 0}, None, "max_tokens must be at least 1"),
    ({"top_p": 0}, None, "top_p must be above 0"),
    ({"n": 2}, "n", "n must be 1"),
    ({"frequency_penalty": 0.5}, "frequency_penalty", "frequency_penalty is not available"),
    ({"messages": []}, "messages", "messages must be a non-empty list"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "role must be one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages",
     "text parts"),
    ({"stop": 3}, "stop", "stop must be a string"),
    ({"stream": "yes"}, "stream", "stream must be true or false"),
    ({"duet": {"accept": "maybe"}}, "duet.accept", "duet.accept must be one of exact, lossy"),
    ({"duet": {"route": "w8a8"}}, "duet.route", "duet.route must be one of w4a16, w4a8, bf16"),
    ({"duet": {"depth": 9}}, "duet.depth", "duet.depth must be auto or 1 to 4 for auto drafts"),
])
def test_bad_requests_are_400_with_a_json_error(demo, body, param, words):
    request = {"model": "demo_int4", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body}
    response = httpx.post(f"{demo.url}/chat/completions", json=request, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"


def test_unknown_fields_are_ignored_and_broken_json_is_400(demo):
    request = {"model": "anything", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
               "user": "me", "some_new_field": {"x": 1}, "frequency_penalty": 0, "logprobs": False}
    assert httpx.post(f"{demo.url}/chat/completions", json=request, timeout=60).status_code == 200
    broken = httpx.post(f"{demo.url}/chat/completions", content=b'{"messages": [', timeout=60)
    assert broken.status_code == 400 and "not JSON" in broken.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        demo.client.chat.completions.create(model="demo_int4", messages=request["messages"], n=2)


def test_a_prompt_over_the_budget_is_400_naming_it(endless):
    with pytest.raises(openai.BadRequestError, match=r"context budget is 4,096"):
        endless.client.completions.create(model="endless", prompt="word " * 5000, max_tokens=4)


def test_a_key_guards_every_endpoint_and_is_never_logged(endless):
    for key in ("wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert httpx.get(f"{endless.url}/models", headers=headers).status_code == 401
        response = httpx.post(f"{endless.url}/completions", json={"prompt": "a", "max_tokens": 2}, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=endless.url, api_key="wrong", max_retries=0).models.list()
    assert endless.client.completions.create(model="endless", prompt="a b c", max_tokens=3).usage.completion_tokens == 3
    assert not any(KEY in line for line in endless.lines)


def test_a_client_that_leaves_mid_stream_frees_the_engine(endless):
    """The endless model runs to its budget unless cancelled; after a client reads a few chunks and
    closes, its reply ends within a few cycles and the next request is served; likewise a client that
    stops waiting for a whole reply."""
    headers = {"Authorization": f"Bearer {KEY}"}
    request = {"prompt": "one two three", "max_tokens": 100_000, "stream": True, "temperature": 0}
    done_before = len(endless.engine.history)
    with httpx.stream("POST", f"{endless.url}/completions", json=request, headers=headers, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(line for line in lines if line.startswith("data: "))
    wait_until(lambda: len(endless.engine.history) > done_before, "the engine did not stop after the client left")
    left = endless.engine.history[-1]
    assert left.finish == "cancelled"  # not "context": it stopped before the budget
    after = endless.client.completions.create(model="endless", prompt="one two", max_tokens=5, temperature=0)
    assert after.usage.completion_tokens == 5

    request["stream"] = False  # a client that gives up on a whole reply: the server notices while it runs
    done_before = len(endless.engine.history)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{endless.url}/completions", json=request, headers=headers, timeout=1.0)
    wait_until(lambda: len(endless.engine.history) > done_before, "the engine did not stop after the client left")
    gave_up = endless.engine.history[-1]
    assert gave_up.finish == "cancelled"  # not "context": it stopped before the budget


def test_concurrent_clients_are_served_in_arrival_order_and_none_is_lost(demo):
    """50 requests from 4 clients: every one answered, each run in the order it arrived."""
    def ask(i: int) -> dict:
        reply = demo.client.chat.completions.create(
            model="demo_int4", messages=[{"role": "user", "content": f"Verse {i}"}], max_tokens=16, temperature=0.7,
            seed=i)
        return {"i": i, "queue": reply.model_extra["duet"]["queue"], "tokens": reply.usage.completion_tokens}

    start = time.perf_counter()
    with ThreadPoolExecutor(4) as clients:
        answers = list(clients.map(ask, range(50)))
    wall = time.perf_counter() - start
    received = sorted(a["queue"]["received"] for a in answers)
    assert len(answers) == 50 and received == list(range(received[0], received[0] + 50))
    assert all(a["queue"]["started"] == a["queue"]["received"] for a in answers)
    assert all(a["tokens"] > 0 for a in answers)
    waits = sorted(a["queue"]["waited_s"] for a in answers)
    print(f"50 requests, 4 clients: {wall:.2f} s, {50 / wall:.1f} requests/s, "
          f"{sum(a['tokens'] for a in answers) / wall:.0f} tokens/s, queue wait median {waits[25] * 1e3:.0f} ms, "
          f"max {waits[-1] * 1e3:.0f} ms")


def test_ctrl_c_stops_the_server_while_a_reply_streams(endless_model):
    env = {**os.environ, "DUET_API_KEY": KEY}
    server = subprocess.Popen([sys.executable, "-m", "duet.app.cli", "serve", "--model", str(endless_model),
                               "--port", "0", "--context", "4096"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = server.stderr.readline()
        port = re.search(r"http://127\.0\.0\.1:(\d+)/v1", first).group(1)
        headers = {"Authorization": f"Bearer {KEY}"}
        request = {"prompt": "one two three", "max_tokens": 100_000, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=request, headers=headers,
                          timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            server.send_signal(signal.SIGINT)
            rest = [line for line in lines if line]  # the stream ends: the reply was cancelled at its next cycle
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "cancelled"' in rest[-2]
        assert server.wait(timeout=30) == EXIT_INTERRUPTED  # what the command line answers Ctrl-C with
        err = server.stderr.read()
        assert "Traceback" not in err and KEY not in first + err
    finally:
        server.kill()


def test_a_taken_port_or_a_budget_past_the_model_is_one_line(tiny_model, capsys):
    taken = bind("127.0.0.1", 0)
    try:
        assert main(["serve", "--model", str(tiny_model), "--port", str(taken.getsockname()[1])]) == 2
        assert re.fullmatch(r"duet: cannot listen on 127\.0\.0\.1:\d+: .+; choose another --port or --host\n",
                            capsys.readouterr().err)
    finally:
        taken.close()
    assert main(["serve", "--model", str(tiny_model), "--port", "0", "--context", "999999"]) == 2
    assert capsys.readouterr().err == "duet: --context must be from 2 to 4,096 tokens (got 999,999)\n"
