"""vLLM's OpenAI app on the async engine, on the wire: streaming equals the full response, stop strings,
structured outputs under speculation, a three-turn conversation that keeps the model's tokens, a short request
answered while a long one runs, unknown and unhonoured fields refused by name, and malformed bodies answered
with 4xx while the server keeps serving.

One server engine (tests/openai_server.py) for the module. Requests go through the real ``openai`` client where
a client would use it, and raw HTTP where the test is about the wire. Nothing here asserts a duration.
"""

from __future__ import annotations

import asyncio

import pytest

from openai_server import HTTP_TIMEOUT, MODEL_NAME, SPEC_K, base_url, post, start_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def srv(request, local_ray, toy):
    return start_server(request, toy)


@pytest.fixture(scope="module")
def url(srv):
    return base_url(srv)


def _stream_chat(url, body):
    """(content, token ids, log-probs, prompt ids, finish reason, usage) assembled from a streamed chat."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT)
    text, ids, lps, prompt, finish, usage, chunks = "", [], [], None, None, None, 0
    for ch in client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        d = ch.model_dump()
        chunks += 1
        prompt = prompt or d.get("prompt_token_ids")
        usage = d.get("usage") or usage
        for c in d["choices"]:
            text += c["delta"].get("content") or ""
            ids += c.get("token_ids") or []
            lps += [x["logprob"] for x in ((c.get("logprobs") or {}).get("content") or [])]
            finish = c.get("finish_reason") or finish
    return text, ids, lps, prompt, finish, usage, chunks


def test_streaming_chat_gives_what_the_full_response_gives(url):
    from openai import OpenAI

    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "9081726354"}],
        "max_tokens": 20,
        "temperature": 0,
    }
    full = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT).chat.completions.create(**body)
    m = full.choices[0].message.to_dict()
    text, ids, lps, prompt, finish, usage, chunks = _stream_chat(url, body)
    assert chunks > 3, "not streamed"
    assert (text, ids, prompt, finish) == (
        m["content"],
        m["generation_token_ids"],
        m["prompt_token_ids"],
        full.choices[0].finish_reason,
    )
    assert len(lps) == len(ids) and usage["completion_tokens"] == len(ids)


def test_streaming_completions_give_what_the_full_response_gives(url):
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT)
    body = {
        "model": MODEL_NAME,
        "prompt": "9081726354=",
        "max_tokens": 20,
        "temperature": 0,
        "extra_body": {"return_token_ids": True},
    }
    full = client.completions.create(**body).model_dump()["choices"][0]
    text, ids, per_chunk = "", [], []
    for ch in client.completions.create(**body, stream=True):
        for c in ch.model_dump()["choices"]:
            text += c.get("text") or ""
            ids += c.get("token_ids") or []
            per_chunk.append(len(c.get("token_ids") or []))
    assert text == full["text"] and ids == full["token_ids"] and len(ids) > 3
    # Streaming sends what each engine step emitted: a step emits at most k + 1 tokens per request
    # (k drafts and the bonus token), so there is at least one chunk per k + 1 tokens.
    k = SPEC_K
    assert max(per_chunk) <= k + 1 and sum(1 for n in per_chunk if n) >= -(-len(ids) // (k + 1)), per_chunk


def test_stop_strings(url, tokenizer):
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT)
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "9081726354"}], max_tokens=20, temperature=0, stop=["5"]
    )
    c = r.model_dump()["choices"][0]
    assert c["message"]["content"] == "01234" and c["finish_reason"] == "stop" and c["stop_reason"] == "5"
    # the ids run up to and include the stop string
    assert tokenizer.decode(c["message"]["generation_token_ids"]) == "012345"
    r = client.completions.create(model=MODEL_NAME, prompt="9081726354=", max_tokens=20, temperature=0, stop=["3"])
    assert r.choices[0].text == "012" and r.choices[0].finish_reason == "stop"


def test_structured_outputs_under_speculation(url):
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT)
    msgs = [{"role": "user", "content": "9081726354"}]
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 700, "maximum": 799}},
    }
    txt = (
        client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=8, seed=5, response_format=rf)
        .choices[0]
        .message.content
    )
    assert txt.isdigit() and 700 <= int(txt) <= 799, txt  # the sorted answer would start with 0
    txt = (
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=msgs,
            max_tokens=8,
            seed=5,
            extra_body={"structured_outputs": {"regex": "9[0-9]9"}},
        )
        .choices[0]
        .message.content
    )
    assert len(txt) == 3 and txt[0] == txt[2] == "9", txt


def test_three_turn_conversation_keeps_the_models_tokens(url, tokenizer):
    """Turn 1 ends with EOS, turn 2 stops at max_tokens. The client sends turn 1 back with its text
    cleared (as templates that drop earlier reasoning do: the re-rendered history gets shorter and
    every later position shifts). The final prompt must still start with exactly the tokens of every
    earlier turn; /tokenize of the same history gives the same spliced ids."""
    import httpx
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT)

    def turn(messages, **kw):
        r = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, **kw)
        msg = r.choices[0].message.to_dict()  # the extra fields come back with the message
        return msg, r.choices[0].finish_reason

    # the first prompt whose greedy answer stops (the toy's answers differ with the machine that trained it)
    for first in ("31415", "2718", "4321", "90817"):
        m1, f1 = turn([{"role": "user", "content": first}], max_tokens=30)
        if f1 == "stop":
            break
    assert f1 == "stop" and m1["generation_token_ids"][-1] == tokenizer.eos_token_id
    assert m1["prompt_token_ids"] == tokenizer.encode(first + "=")
    assert len(m1["generation_token_ids"]) > 1 and m1["content"]

    history = [{"role": "user", "content": first}, dict(m1, content=""), {"role": "user", "content": "27"}]
    m2, f2 = turn(history, max_tokens=3)
    assert f2 == "length" and len(m2["generation_token_ids"]) == 3
    turn1 = m1["prompt_token_ids"] + m1["generation_token_ids"]
    assert m2["prompt_token_ids"] == turn1 + tokenizer.encode("27=")

    history += [m2, {"role": "user", "content": "9"}]
    m3, _ = turn(history, max_tokens=10)
    turn2 = m2["prompt_token_ids"] + m2["generation_token_ids"]
    final = m3["prompt_token_ids"]
    assert final[: len(turn1)] == turn1
    assert final[: len(turn2)] == turn2
    assert final[len(turn2)] == tokenizer.eos_token_id  # the template closes the truncated turn
    assert final[len(turn2) + 1 :] == tokenizer.encode("9=")
    root = url.removesuffix("/v1")
    t = httpx.post(
        root + "/tokenize",
        json={"model": MODEL_NAME, "messages": history, "add_generation_prompt": True},
        timeout=HTTP_TIMEOUT,
    )
    assert t.json()["tokens"] == final
    plain = [{"role": m["role"], "content": m["content"]} for m in history]  # without the ids: the template's rendering
    t = httpx.post(
        root + "/tokenize",
        json={"model": MODEL_NAME, "messages": plain, "add_generation_prompt": True},
        timeout=HTTP_TIMEOUT,
    )
    assert t.json()["tokens"] != final


def test_short_request_is_answered_while_a_long_one_runs(url):
    import httpx

    async def main():
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
            body = {"model": MODEL_NAME, "prompt": "31415=", "temperature": 0, "return_token_ids": True}
            long = asyncio.ensure_future(
                client.post(url + "/completions", json={**body, "max_tokens": 60, "ignore_eos": True})
            )
            await asyncio.sleep(0)  # the long request goes out first
            short = await client.post(url + "/completions", json={**body, "max_tokens": 2})
            long_done_first = long.done()
            long_r = await asyncio.wait_for(long, HTTP_TIMEOUT)
            return short, long_done_first, long_r

    short, long_done_first, long_r = asyncio.run(main())
    assert short.status_code == 200 and long_r.status_code == 200
    assert len(short.json()["choices"][0]["token_ids"]) == 2
    assert len(long_r.json()["choices"][0]["token_ids"]) == 60
    assert not long_done_first


UNKNOWN_FIELDS = [  # (path, body additions, the field the 400 must name)
    ("/chat/completions", {"frobnicate": 1}, "frobnicate"),
    ("/chat/completions", {"stream": True, "stream_options": {"include_usage": True, "zzz": 1}}, "stream_options.zzz"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "31", "foo": 1}]}, "messages[0].foo"),
    ("/completions", {"prompt": "31=", "frobnicate": 1}, "frobnicate"),
]


@pytest.mark.parametrize("path, extra, name", UNKNOWN_FIELDS)
def test_an_unknown_field_is_refused_with_its_name(url, path, extra, name):
    import httpx

    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "31"}], "max_tokens": 3, **extra}
    if path == "/completions":
        body.pop("messages")
    r = httpx.post(url + path, json=body, timeout=HTTP_TIMEOUT)
    assert r.status_code == 400 and name in r.json()["error"]["message"], r.text


def test_the_openai_client_sees_unknown_and_unhonoured_fields_refused(url):
    """extra_body with a typo, and fields vLLM ignores under speculation; vLLM's own extras, top_k and
    echoed response-only message keys (null) are accepted."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT)
    msgs = [{"role": "user", "content": "31"}]
    for extra, name in [({"top_kk": 5}, "top_kk"), ({"logit_bias": {"3": 5}}, "logit_bias"), ({"min_p": 0.2}, "min_p")]:
        with pytest.raises(openai.BadRequestError, match=name):
            client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=3, extra_body=extra)
    ok = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "31", "annotations": None}],
        max_tokens=5,
        temperature=1.0,
        extra_body={"top_k": 3, "min_tokens": 1, "repetition_penalty": 1.0},
    )
    assert ok.choices[0].finish_reason in ("stop", "length") and ok.choices[0].message.to_dict()["generation_token_ids"]


BAD_REQUESTS = [
    ("/chat/completions", b"{not json", 400),
    ("/chat/completions", {"model": MODEL_NAME}, 400),  # no messages
    ("/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "1"}]}, 400),
    (
        "/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "system", "content": "1"}]},
        400,
    ),  # template refuses
    (
        "/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "1"}], "temperature": "hot"},
        400,
    ),
    (
        "/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "1"}], "logprobs": True, "top_logprobs": 50},
        400,
    ),
    ("/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "1"}]}, 404),
    (
        "/chat/completions",
        {
            "model": MODEL_NAME,
            "messages": [
                {"role": "user", "content": "1"},
                {"role": "assistant", "content": "1", "prompt_token_ids": [3, 12]},
                {"role": "user", "content": "2"},
            ],
        },
        400,
    ),
    (
        "/chat/completions",
        {
            "model": MODEL_NAME,
            "messages": [
                {"role": "user", "content": "1"},
                {"role": "assistant", "content": "1", "prompt_token_ids": [3, 12], "generation_token_ids": [3, 99999]},
                {"role": "user", "content": "2"},
            ],
        },
        400,
    ),
    ("/completions", {"model": MODEL_NAME, "prompt": 5}, 400),
    ("/completions", {"model": MODEL_NAME, "prompt": [3, 99]}, 400),  # not a token id of the model
    ("/completions", {"model": MODEL_NAME, "prompt": "1" * 200}, 400),  # longer than max_model_len
    ("/completions", {"model": MODEL_NAME, "prompt": "31=", "max_tokens": 500}, 400),
    ("/completions", {"model": MODEL_NAME, "prompt": "31=", "max_tokens": 0}, 400),
]


def _client_errors(url: str) -> int:
    """4xx answers the app counted so far (vLLM's Prometheus middleware, /metrics)."""
    import httpx

    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=HTTP_TIMEOUT).text
    return sum(
        int(float(ln.rsplit(" ", 1)[1]))
        for ln in text.splitlines()
        if ln.startswith("http_requests_total{") and 'status="4xx"' in ln
    )


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(url):
    import httpx

    before = _client_errors(url)
    for path, body, status in BAD_REQUESTS:
        r = post(url, path, body)
        assert r.status_code == status, (path, body, r.status_code, r.text)
        assert r.json()["error"]["message"], (path, body)
    r = httpx.post(url + "/nowhere", json={}, timeout=HTTP_TIMEOUT)
    assert r.status_code == 404
    ok = post(
        url,
        "/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "31415"}], "max_tokens": 30, "temperature": 0},
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    assert _client_errors(url) - before >= len(BAD_REQUESTS)
