"""Conversation caches on one server: the next turn of a conversation starts from the state the
previous turn left, reports the reuse in `usage.prompt_cache_hit_tokens`, and answers exactly
what a server that recomputed the whole prompt answers."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_fixture import Server, http, server_env  # noqa: E402
from test_server import cache_home  # noqa: E402, F401

from dsuf.api.chat import ChatFrontend  # noqa: E402
from dsuf.serve import default_tokenizer  # noqa: E402

EOS = 1
CHAT = ChatFrontend(default_tokenizer(), served_name="x", context_limit=1024, family="v4")


def ids(text: str) -> list[int]:
    return list(CHAT._tokenizer.encode(text))


def prompt_len(messages: list[dict], thinking: bool) -> int:
    body = {"model": "x", "messages": messages, "thinking": {"type": "enabled" if thinking else "disabled"}}
    return len(CHAT.prepare(body).prompt_ids)


@pytest.fixture(scope="module")
def servers(cache_home, tmp_path_factory):
    """A caching server and a reference one that recomputes every prompt."""
    logs = tmp_path_factory.mktemp("cc-logs")
    env = server_env(cache_home)
    cached = Server(logs / "cached.log", ["--test-hooks", "--kv-host-bytes", str(64 << 20)], env)
    plain = Server(logs / "plain.log", ["--test-hooks", "--kv-host-bytes", "0"], env)
    try:
        cached.wait_ready()
        plain.wait_ready()
        yield cached, plain
    finally:
        cached.stop()
        plain.stop()


def chat(server: Server, messages: list[dict], *, thinking: bool = False, forced: list[int] | None = None,
         headers: dict | None = None, **extra) -> dict:
    # thinking mode samples at temperature 1 whatever the request says: the seed makes it repeatable
    body = {"model": "deepseek-v4-flash", "messages": messages, "max_tokens": 8, "temperature": 0, "seed": 1234,
            "thinking": {"type": "enabled" if thinking else "disabled"}, "logprobs": True, **extra}
    if forced is not None:
        body["dsuf_forced_tokens"] = forced
    status, _, raw = http("POST", server.url + "/v1/chat/completions", body, headers=headers)
    assert status == 200, raw
    return json.loads(raw)


def answer(resp: dict) -> tuple:
    """What must not change when a prompt comes from the cache: the reasoning, the text and every
    token's logprob (where the API reports them: not in thinking mode)."""
    choice = resp["choices"][0]
    tokens = [(t["token"], round(t["logprob"], 4)) for t in (choice.get("logprobs") or {}).get("content") or []]
    message = choice["message"]
    assert message.get("content") or message.get("reasoning_content"), "an empty answer proves nothing"
    return message.get("reasoning_content"), message.get("content"), choice["finish_reason"], tokens


def hit(resp: dict) -> int:
    return resp["usage"].get("prompt_cache_hit_tokens", 0)


def test_the_next_turn_starts_after_the_previous_answer(servers):
    cached, plain = servers
    turn1 = [{"role": "user", "content": "Name a colour."}]
    reply = "Blue, like the sky."
    first = chat(cached, turn1, forced=ids(reply) + [EOS])
    assert first["choices"][0]["message"]["content"] == reply and hit(first) == 0

    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Another one?"}]
    second = chat(cached, turn2)
    # the snapshot after turn 1's EOS: its prompt, its answer and the EOS are all reused
    assert hit(second) == prompt_len(turn1, False) + len(ids(reply)) + 1
    reference = chat(plain, turn2)
    assert hit(reference) == 0
    assert answer(second) == answer(reference)


def test_a_thinking_conversation_reuses_its_prompt_up_to_the_dropped_reasoning(servers):
    cached, plain = servers
    turn1 = [{"role": "user", "content": "Think, then name a fruit."}]
    think, reply = ids("Hmm, fruit."), "Pear."
    first = chat(cached, turn1, thinking=True, forced=think + ids("</think>") + ids(reply) + [EOS])
    assert first["choices"][0]["message"]["content"] == reply
    # the next prompt renders turn 1's answer without its reasoning: everything up to turn 1's
    # <｜Assistant｜> is common, the rest differs
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And a vegetable?"}]
    second = chat(cached, turn2, thinking=True)
    assert hit(second) == prompt_len(turn1, True) - 1
    assert answer(second) == answer(chat(plain, turn2, thinking=True))


def test_the_same_prompt_again_reuses_all_but_its_last_token(servers):
    cached, plain = servers
    messages = [{"role": "user", "content": "Say something about caches."}]
    first, again = chat(cached, messages), chat(cached, messages)
    assert hit(first) == 0 and hit(again) == prompt_len(messages, False) - 1
    assert answer(again) == answer(first) == answer(chat(plain, messages))


def test_a_streamed_turn_reports_the_reuse_in_its_usage(servers):
    cached, _ = servers
    messages = [{"role": "user", "content": "Stream me a word."}]
    chat(cached, messages)
    body = {"model": "deepseek-chat", "messages": messages, "max_tokens": 4, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    status, _, raw = http("POST", cached.url + "/v1/chat/completions", body)
    assert status == 200
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
    usage = events[-1]["usage"]
    assert usage["prompt_cache_hit_tokens"] == prompt_len(messages, False) - 1
    assert usage["prompt_cache_miss_tokens"] == 1


def test_metrics_count_the_snapshots_and_the_hits(servers):
    cached, _ = servers
    messages = [{"role": "user", "content": "Count me."}]
    chat(cached, messages)
    assert hit(chat(cached, messages)) > 0
    status, _, raw = http("GET", cached.url + "/metrics")
    text = raw.decode()
    assert status == 200
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith("dsuf:kv_cache")}
    assert values["dsuf:kv_cache_entries"] > 0 and values["dsuf:kv_cache_bytes"] > 0
    assert values['dsuf:kv_cache_events{kind="local_hits"}'] > 0


def test_a_bad_prompt_cache_key_is_a_400(servers):
    cached, _ = servers
    status, _, raw = http("POST", cached.url + "/v1/chat/completions",
                          {"model": "deepseek-chat", "messages": [{"role": "user", "content": "x"}], "prompt_cache_key": 7})
    assert status == 400 and json.loads(raw)["error"]["param"] == "prompt_cache_key"


def test_a_cache_smaller_than_a_snapshot_still_answers_correctly(cache_home, tmp_path, servers):
    _, plain = servers
    tiny = Server(tmp_path / "tiny.log", ["--kv-host-bytes", "4096"], server_env(cache_home))
    try:
        tiny.wait_ready()
        messages = [{"role": "user", "content": "Tiny cache?"}]
        first, again = chat(tiny, messages), chat(tiny, messages)
        assert hit(first) == hit(again) == 0  # nothing fits: every snapshot is refused, nothing breaks
        assert answer(again) == answer(chat(plain, messages))
        assert "not kept" in tiny.log()
    finally:
        assert tiny.stop() == 0


def test_the_snapshots_a_dead_worker_was_making_are_given_up():
    """Between a worker's SnapshotMade and its write, the front end holds a region for it: if the
    worker dies there, the region must come back and a turn waiting for that snapshot recomputes."""
    from dsuf.engine.scheduler import Scheduler
    from dsuf.ipc.messages import SeqWork, SnapshotMade, Step, StepDone
    from dsuf.kvcache.cache import ConversationCache
    from dsuf.kvcache.store import HostStore

    async def main() -> None:
        store = HostStore(1 << 20)
        cache = ConversationCache(store, model_id="m", revision="r", assistant_id=5, boundary_ids={6})
        scheduler = Scheduler(4, 4, 64, eos_token_id=EOS)
        cache.expect(Step(1, [SeqWork(7, [3, 4, 5], sample=True, snapshot="k")]))
        coming = cache._coming["k"]
        cache.on_step(StepDone(1, [], 0.0, snapshots=[SnapshotMade(7, "k", 3, 4096)]), scheduler)
        assert store.bytes_used == 4096 and not coming.done()  # reserved, to be written next step

        cache.worker_lost()
        assert store.bytes_used == 0 and "k" not in store
        assert coming.done() and coming.result() is False
        store.reserve("all", 1, 1 << 20)  # the whole budget is free again

    asyncio.run(main())
