#!/usr/bin/env python3
"""Drive a running `gpu-offload serve` through the official `openai` Python client and check
what it gets back: completions and chat, logprobs, n, streaming, penalties, logit_bias, and
the 400s for what the server refuses.

Usage: openai-client-check.py BASE_URL   (e.g. http://127.0.0.1:8080)
Exit status 0 when every check holds; an assertion names the one that does not.
Written for a small model without a chat template (stories260K); any model works.
"""

import math
import sys

import openai


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def main(base):
    client = openai.OpenAI(base_url=base.rstrip("/") + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    prompt = "Once upon a time"
    msgs = [{"role": "user", "content": "Tell me a story."}]

    # Completions: greedy, logprobs with alternatives; the chosen token is the most likely.
    r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    c = r.choices[0]
    lp = c.logprobs
    check(len(lp.tokens) == 12 == r.usage.completion_tokens, "completions: 12 tokens with logprobs")
    check("".join(lp.tokens) == c.text, "completions: tokens spell the text")
    check(lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset), "text_offset")
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        check(chosen <= 0 and 0 < len(top) <= 3, "completions: logprob and top_logprobs sizes")
        check(math.isclose(max(top.values()), chosen, abs_tol=1e-6), "greedy took the most likely")
    greedy_text = c.text
    print("completions logprobs: ok")

    # Streamed: the same text and log-probabilities.
    text, lps = "", []
    for ch in client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=3, stream=True
    ):
        for choice in ch.choices:
            text += choice.text
            if choice.logprobs is not None:
                lps += choice.logprobs.token_logprobs
    check(text == greedy_text, "streamed completion text")
    check(all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(lps, lp.token_logprobs))
          and len(lps) == 12, "streamed completion logprobs")
    print("completions logprobs streamed: ok")

    # n: greedy choices are identical; sampled ones are seeded by seed + index.
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, n=3)
    check([ch.index for ch in r.choices] == [0, 1, 2], "n=3 indices")
    check(len({ch.text for ch in r.choices}) == 1, "greedy choices identical")
    check(r.usage.completion_tokens == sum(8 for _ in r.choices), "usage counts every choice")

    def sampled(n, seed, stream=False):
        args = dict(model=model, prompt=prompt, max_tokens=16, temperature=1.0, seed=seed, n=n,
                    extra_body={"ignore_eos": True})
        if not stream:
            return [ch.text for ch in client.completions.create(**args).choices]
        out = [""] * n
        for ch in client.completions.create(stream=True, **args):
            for choice in ch.choices:
                out[choice.index] += choice.text
        return out

    three = sampled(3, 11)
    check(three == sampled(3, 11), "n=3 with a seed repeats")
    check(len(set(three)) > 1, "sampled choices differ")
    check(all(sampled(1, 11 + i)[0] == t for i, t in enumerate(three)), "choice i is seed + i")
    check(sampled(3, 11, stream=True) == three, "n=3 streamed by index")
    print("n: ok")

    # Penalties change greedy output; logit_bias forces or bans a token.
    r = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0)
    p = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0,
                                  frequency_penalty=2.0, presence_penalty=1.0)
    check(p.choices[0].text != r.choices[0].text, "penalties change the greedy text")
    f = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0,
                                  logit_bias={"403": 100}, logprobs=1)
    toks = f.choices[0].logprobs.tokens
    check(len(set(toks)) == 1 and len(toks) == 5, "logit_bias +100 forces one token")
    check(all(x > -1e-3 for x in f.choices[0].logprobs.token_logprobs), "forced token logprob ~0")
    print("penalties and logit_bias: ok")

    # Chat (ChatML when the model has no template): logprobs with top_logprobs, streamed, n.
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    check(len(content) == r.usage.completion_tokens, "chat: one logprob per token")
    for e in content:
        check(bytes(e.bytes).decode("utf-8", "replace") == e.token, "chat: bytes spell the token")
        check(len(e.top_logprobs) == 2 and math.isclose(e.top_logprobs[0].logprob, e.logprob,
                                                        abs_tol=1e-6), "chat: top_logprobs")
    text, streamed = "", []
    for ch in client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                             logprobs=True, top_logprobs=2, stream=True):
        for choice in ch.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                streamed += [e.logprob for e in choice.logprobs.content]
    check(text == r.choices[0].message.content, "chat streamed text")
    check(len(streamed) == len(content) and all(
        math.isclose(a, e.logprob, abs_tol=1e-6) for a, e in zip(streamed, content)), "chat streamed logprobs")
    r2 = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0, n=2)
    check(len(r2.choices) == 2 and r2.choices[0].message.content == r2.choices[1].message.content,
          "chat n=2 greedy")
    print("chat: ok")

    # Refused: a 400 naming the field.
    bad = [
        ("n", lambda: client.completions.create(model=model, prompt="x", n=17)),
        ("logprobs", lambda: client.completions.create(model=model, prompt="x", logprobs=6)),
        ("presence_penalty", lambda: client.completions.create(model=model, prompt="x", presence_penalty=3)),
        ("logit_bias", lambda: client.completions.create(model=model, prompt="x", logit_bias={"999999": 1})),
        ("top_logprobs", lambda: client.chat.completions.create(model=model, messages=msgs, logprobs=True,
                                                                top_logprobs=21)),
        ("response_format", lambda: client.chat.completions.create(
            model=model, messages=msgs, response_format={"type": "json_object"})),
        ("tools", lambda: client.chat.completions.create(
            model=model, messages=msgs,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])),
    ]
    for field, call in bad:
        try:
            call()
        except openai.BadRequestError as e:
            body = e.body if isinstance(e.body, dict) else {}
            err = body.get("error", body)
            check(err.get("param") == field and field in str(err.get("message")),
                  f"400 for '{field}' names it: {err}")
        else:
            raise AssertionError(f"'{field}' was not refused")
    print("400s: ok")
    print("openai client check: all ok")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
