#!/usr/bin/env python3
"""Calls an LLM API through floodgate with the official Python SDKs (`openai`, `anthropic`), as
their users do, for the tests in integration/tests/llm_sdk.rs. Everything goes to the base URL
given (a local Envoy on 127.0.0.1), and every call is bounded in time.

    sdk.py --sdk openai|anthropic --api chat|responses|messages --base-url URL --key KEY
           [--n N] [--stream] [--max-tokens M] [--usage T] [--prompt P] [--max-retries R]
           [--accept-encoding VALUE]

Makes N calls one after another (chat: Chat Completions, responses: OpenAI's Responses,
messages: Anthropic's Messages), each asking M max tokens, streamed or not, with the SDK's own
retries (its default, 2, unless --max-retries). The test upstream reports T tokens, P of them
input (headers x-test-usage, x-test-prompt, sent as the client's default headers). Prints one
JSON object: "calls" (each: ok, the error's type and str() if it failed, the text received,
elapsed seconds) and "exchanges" (every HTTP request and response the SDK's HTTP client saw, in
order: time, status, retry-after-ms, retry-after, the request's accept-encoding, the response's
content-encoding).
"""

import argparse
import json
import sys
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sdk", choices=["openai", "anthropic"], required=True)
    parser.add_argument("--api", choices=["chat", "responses", "messages"], required=True)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--usage", type=int, default=0)
    parser.add_argument("--prompt", type=int, default=0)
    parser.add_argument("--max-retries", type=int, default=None)
    parser.add_argument("--accept-encoding", default=None)
    args = parser.parse_args()

    exchanges = []

    def on_request(request):
        exchanges.append({"t": time.monotonic(), "kind": "request",
                          "accept_encoding": request.headers.get("accept-encoding")})

    def on_response(response):
        exchanges.append({"t": time.monotonic(), "kind": "response", "status": response.status_code,
                          "retry_after_ms": response.headers.get("retry-after-ms"),
                          "retry_after": response.headers.get("retry-after"),
                          "content_encoding": response.headers.get("content-encoding")})

    headers = {"x-test-usage": str(args.usage), "x-test-prompt": str(args.prompt)}
    if args.accept_encoding is not None:
        headers["accept-encoding"] = args.accept_encoding
    hooks = {"request": [on_request], "response": [on_response]}
    options = {"base_url": args.base_url, "api_key": args.key, "default_headers": headers, "timeout": 30.0}
    if args.max_retries is not None:
        options["max_retries"] = args.max_retries
    if args.sdk == "openai":
        import openai
        client = openai.OpenAI(http_client=openai.DefaultHttpxClient(event_hooks=hooks), **options)
    else:
        import anthropic
        client = anthropic.Anthropic(http_client=anthropic.DefaultHttpxClient(event_hooks=hooks), **options)

    def call():
        messages = [{"role": "user", "content": "hi"}]
        if args.api == "chat":
            extra = {"stream_options": {"include_usage": True}} if args.stream else {}
            answer = client.chat.completions.create(model="test", messages=messages, max_tokens=args.max_tokens,
                                                    stream=args.stream, **extra)
            if args.stream:
                return "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
            return answer.choices[0].message.content
        if args.api == "responses":
            answer = client.responses.create(model="test", input="hi", max_output_tokens=args.max_tokens, stream=args.stream)
            if args.stream:
                return "".join(e.delta for e in answer if e.type == "response.output_text.delta")
            return answer.output_text
        answer = client.messages.create(model="claude-test", messages=messages, max_tokens=args.max_tokens, stream=args.stream)
        if args.stream:
            return "".join(e.delta.text for e in answer if e.type == "content_block_delta")
        return answer.content[0].text

    calls = []
    for _ in range(args.n):
        started = time.monotonic()
        try:
            text = call()
            calls.append({"ok": True, "text": text, "elapsed": time.monotonic() - started})
        except Exception as error:  # the test reads the SDK's own error and its message
            calls.append({"ok": False, "error_type": type(error).__name__, "error": str(error),
                          "elapsed": time.monotonic() - started})
    json.dump({"calls": calls, "exchanges": exchanges}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
