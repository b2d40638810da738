"""Anthropic's Messages API (`/v1/messages`, also under `/anthropic` as at DeepSeek), through the
official `anthropic` client against a real server: the same model and prompts as chat completions,
Anthropic's content blocks, events, usage and error bodies (converted and parsed by deepseek-recipe)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

anthropic = pytest.importorskip("anthropic")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_fixture import http  # noqa: E402
from test_server import (  # noqa: E402, F401
    CONTEXT, END_THINK, EOS, NO_THINKING, WEATHER_TOOL, as_create_kwargs, cache_home, client, fe, greedy, hf, ids_of, server, start_server, tool_call_block,
)

from dsuf.api.chat import MESSAGES  # noqa: E402

GREEDY = {"temperature": 0}  # (the client no longer takes temperature as an argument; the API does)
WEATHER = {"name": "get_weather", "description": "The weather of a city", "input_schema": WEATHER_TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120) as c:
        yield c


def test_a_message_answers_what_chat_completions_answers_for_the_same_conversation(claude, client, fe):
    chat = client.chat.completions.create(**as_create_kwargs(greedy("Name a colour.", 8)))
    msg = claude.messages.create(model="deepseek-v4-flash", max_tokens=8, messages=[{"role": "user", "content": "Name a colour."}],
                                 extra_body={**GREEDY, **NO_THINKING})
    (block,) = msg.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert msg.stop_reason == "max_tokens" and msg.role == "assistant" and msg.id.startswith("msg_")
    # Anthropic's input_tokens leave out the tokens read from the cache
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert msg.usage.output_tokens == chat.usage.completion_tokens == 8


def test_the_stream_sends_anthropics_events_and_the_same_text(claude):
    kwargs = dict(model="deepseek-chat", max_tokens=8, messages=[{"role": "user", "content": "Tell me a story."}], extra_body=GREEDY)
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert final.content[0].text == whole.content[0].text and final.usage.output_tokens == 8


def test_claude_model_names_are_served_and_echoed(claude):
    msg = claude.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
                                 extra_body=NO_THINKING)
    assert msg.model == "claude-sonnet-4-5" and msg.usage.output_tokens == 2


def test_reasoning_comes_as_a_thinking_block_then_the_answer(claude, hf):
    hi, yo = ids_of(hf, "Hi there"), ids_of(hf, " Yo")
    msg = claude.messages.create(model="deepseek-reasoner", max_tokens=len(hi) + 1 + len(yo) + 1,
                                 messages=[{"role": "user", "content": "Greet me."}],
                                 extra_body={"dsuf_forced_tokens": [*hi, END_THINK, *yo, EOS]})
    thinking, text = msg.content
    assert thinking.type == "thinking" and thinking.thinking == "Hi there" and thinking.signature
    assert text.type == "text" and text.text == " Yo" and msg.stop_reason == "end_turn"
    assert msg.usage.output_tokens == len(hi) + 1 + len(yo)  # (as completion_tokens: EOS is not counted)


def test_a_tool_call_is_a_tool_use_block_and_its_result_goes_back(claude, fe, hf):
    forced = ids_of(hf, tool_call_block(fe, hf)) + [EOS]
    question = [{"role": "user", "content": "Weather in Paris?"}]
    msg = claude.messages.create(model="deepseek-chat", max_tokens=len(forced) + 2, messages=question, tools=[WEATHER],
                                 extra_body={"dsuf_forced_tokens": forced})
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}

    history = question + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]}]
    followup = claude.messages.create(model="deepseek-chat", max_tokens=2, messages=history, tools=[WEATHER], extra_body=GREEDY)
    counted = claude.messages.count_tokens(model="deepseek-chat", messages=history, tools=[WEATHER])
    assert followup.stop_reason == "max_tokens"
    assert followup.usage.input_tokens + followup.usage.cache_read_input_tokens == counted.input_tokens


def test_dsuf_serves_it_under_deepseeks_anthropic_base_url_too(server):
    with anthropic.Anthropic(base_url=server.url + "/anthropic", api_key="x", max_retries=0) as c:
        assert c.messages.create(model="deepseek-chat", max_tokens=1, messages=[{"role": "user", "content": "Hi"}]).usage.output_tokens == 1


@pytest.mark.parametrize("body, status, kind, words", [
    ({"model": "gpt-4", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error", "gpt-4"),
    ({"model": "deepseek-chat", "max_tokens": 4, "messages": []}, 400, "invalid_request_error", "at least one message"),
    ({"model": "deepseek-chat", "max_tokens": 4, "messages": [{"role": "user", "content": "x " * CONTEXT}]}, 400, "invalid_request_error", "context length"),
    ("{not json", 400, "invalid_request_error", "JSON"),
])
def test_bad_requests_get_anthropic_error_bodies(server, body, status, kind, words):
    got, _, raw = http("POST", server.url + "/v1/messages", body)
    error = json.loads(raw)
    assert got == status and error["type"] == "error" and error["error"]["type"] == kind and words in error["error"]["message"], error


def test_errors_past_the_handler_have_the_same_shape():
    assert MESSAGES.error_body(413, "request body too large") == {
        "type": "error", "error": {"type": "request_too_large", "message": "request body too large"}}
    assert MESSAGES.error_body(503, "restarting")["error"]["type"] == "overloaded_error"


def test_an_api_key_may_come_as_x_api_key(start_server):
    s = start_server("--api-key", "sekret")
    body = {"model": "deepseek-chat", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    assert http("POST", s.url + "/v1/messages", body, headers={"x-api-key": "sekret"})[0] == 200
    status, _, raw = http("POST", s.url + "/v1/messages", body, headers={"x-api-key": "wrong"})
    assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"
    # a bearer token wins over x-api-key, as at DeepSeek
    assert http("POST", s.url + "/v1/messages", body, headers={"Authorization": "Bearer wrong", "x-api-key": "sekret"})[0] == 401
    assert http("POST", s.url + "/v1/chat/completions", greedy("Hi", 1), headers={"x-api-key": "sekret"})[0] == 200


def test_the_next_turn_reads_the_previous_one_from_the_conversation_cache(claude):
    turn = [{"role": "user", "content": "Name a fruit."}]
    first = claude.messages.create(model="deepseek-chat", max_tokens=4, messages=turn, extra_body=GREEDY)
    turn += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "Another?"}]
    second = claude.messages.create(model="deepseek-chat", max_tokens=4, messages=turn, extra_body=GREEDY)
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= prompt  # the first prompt and its answer, from the snapshot
