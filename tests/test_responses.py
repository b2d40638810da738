"""OpenAI's Responses API (`/v1/responses`), through the official `openai` client against a real
server: the same model and prompts as chat completions, with Responses' output items, events,
usage and errors (converted and parsed by deepseek-recipe). Nothing is stored: a request carries
its whole input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_fixture import http  # noqa: E402
from test_server import (  # noqa: E402, F401
    END_THINK, EOS, WEATHER_TOOL, as_create_kwargs, cache_home, client, fe, greedy, hf, ids_of, server, tool_call_block,
)

WEATHER = {"type": "function", **{k: WEATHER_TOOL["function"][k] for k in ("name", "description", "parameters")}}


def test_a_response_answers_what_chat_completions_answers_for_the_same_conversation(client):
    chat = client.chat.completions.create(**as_create_kwargs(greedy("Name a colour.", 8)))
    r = client.responses.create(model="deepseek-chat", input="Name a colour.", max_output_tokens=8, temperature=0)
    assert r.output_text == chat.choices[0].message.content and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + 8 and r.usage.output_tokens_details.reasoning_tokens == 0


def test_the_stream_sends_the_responses_events_and_the_same_text(client):
    kwargs = dict(model="deepseek-chat", input="Tell me a story.", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.usage.output_tokens == 8


def test_reasoning_is_a_reasoning_item_then_the_message(client, hf):
    hi, yo = ids_of(hf, "Hi there"), ids_of(hf, " Yo")
    r = client.responses.create(model="deepseek-reasoner", input="Greet me.", max_output_tokens=len(hi) + len(yo) + 2,
                                extra_body={"dsuf_forced_tokens": [*hi, END_THINK, *yo, EOS]})
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Hi there"
    assert message.type == "message" and r.output_text == " Yo" and r.status == "completed"
    assert r.usage.output_tokens == len(hi) + 1 + len(yo) and r.usage.output_tokens_details.reasoning_tokens == len(hi)


def test_a_legacy_name_without_thinking_turns_reasoning_off(client):
    r = client.responses.create(model="deepseek-chat", input="Hi", max_output_tokens=2)
    assert [item.type for item in r.output] == ["message"]
    assert client.responses.create(model="deepseek-reasoner", input="Hi", max_output_tokens=2).output[0].type == "reasoning"


def test_a_tool_call_is_a_function_call_item_and_its_output_goes_back(client, fe, hf):
    forced = ids_of(hf, tool_call_block(fe, hf)) + [EOS]
    question = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.responses.create(model="deepseek-chat", input=question, tools=[WEATHER], max_output_tokens=len(forced) + 2,
                                extra_body={"dsuf_forced_tokens": forced})
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}

    history = question + [{"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                          {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    followup = client.responses.create(model="deepseek-chat", input=history, tools=[WEATHER], max_output_tokens=2, temperature=0)
    assert followup.usage.input_tokens > r.usage.input_tokens and followup.usage.output_tokens == 2


def test_bad_requests_get_openai_error_bodies(server):
    status, _, raw = http("POST", server.url + "/v1/responses", {"model": "gpt-4", "input": "x"})
    error = json.loads(raw)["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and "gpt-4" in error["message"]


@pytest.mark.parametrize("field, value", [
    ("previous_response_id", "resp_0123"), ("conversation", "conv_1"), ("prompt", {"id": "pmpt_1"}), ("background", True),
])
def test_what_needs_stored_state_is_refused_not_silently_dropped(server, field, value):
    status, _, raw = http("POST", server.url + "/v1/responses", {"model": "deepseek-chat", "input": "And then?", field: value})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == field and "not supported" in error["message"]


def test_store_is_accepted_and_answered_with_store_false(client):
    assert client.responses.create(model="deepseek-chat", input="Hi", max_output_tokens=1, store=True).store is False
