#!/usr/bin/env python3
"""A real gRPC server and client (grpcio, gRPC's C core) for floodgate's gRPC tests.

The tests in integration/tests/grpc.rs start the server behind Envoy and run the client against
Envoy; both run on 127.0.0.1 only and every call is bounded in time. No protobuf code is
generated: the service `floodgate.test.Echo` takes and returns raw bytes.

    peer.py serve [--status CODE] [--delay-ms MS] [--grace-ms MS] [--watch-stdin]
        Prints one JSON line {"port": N} once it serves on 127.0.0.1:N. With --watch-stdin it
        exits when its stdin closes (the test that started it is gone). Methods:
          Unary   (unary-unary)   answers its request's bytes
          Upload  (stream-unary)  reads every request message, answers their count
          Watch   (unary-stream)  sends x-test-messages messages (default 100), one per delay
          Stats   (unary-unary)   answers JSON: {"started": {METHOD: calls that reached it}}
        Per call, request metadata overrides the server's defaults: x-test-status (the gRPC
        status code to end with), x-test-delay-ms (wait before answering, or between messages),
        x-test-headers-first: 1 (send the response headers before failing, so that the status
        travels in the trailers rather than in a trailers-only response). A failing call sends
        no message: without x-test-headers-first its status travels in a trailers-only response.
        On SIGTERM: server.stop(grace) (a GOAWAY to Envoy; calls still running after the grace
        are cancelled), then exit.

    peer.py call TARGET [--method Unary] [--n N] [--concurrency C] [--metadata K=V]...
                 [--timeout-ms MS] [--payload TEXT] [--service-config JSON]
        N calls over ONE channel (one HTTP/2 connection to TARGET, many streams), at most C at
        once. Prints JSON: {"codes": {CODE_NAME: count}, "calls": [{code, details, initial,
        trailing, elapsed_ms}, ...]} (every call, in the order they finished).

    peer.py cancel TARGET --kind unary|upload|watch [--n N] [--after-ms MS] [--metadata K=V]...
        Starts N calls on one channel and cancels each (the client sends RST_STREAM): unary
        calls after MS, upload (client-streaming) calls after their first request message and
        MS (the request is not finished), watch (server-streaming) calls after their first
        response message. Prints {"codes": {...}, "calls": [...]}.

    peer.py close TARGET [--n N] [--after-ms MS] [--metadata K=V]...
        Starts N unary calls on one channel, then closes the channel after MS (every call is
        cancelled and the connection closed). Prints {"codes": {...}, "calls": [...]}.

    peer.py stats TARGET
        Prints the server's Stats answer (TARGET is the server itself, not Envoy).
"""

import argparse
import json
import os
import signal
import sys
import threading
import time
from concurrent import futures

import grpc

SERVICE = "floodgate.test.Echo"


def metadata_dict(metadata):
    return {k: v for k, v in (metadata or ())}


# ------------------------------------------------------------------------------------------
# Server
# ------------------------------------------------------------------------------------------


class Counts:
    """Calls that reached the server, per method."""

    def __init__(self):
        self.lock = threading.Lock()
        self.started = {}

    def start(self, method):
        with self.lock:
            self.started[method] = self.started.get(method, 0) + 1

    def snapshot(self):
        with self.lock:
            return {"started": dict(self.started)}


def code_of(number):
    for code in grpc.StatusCode:
        if code.value[0] == number:
            return code
    raise ValueError(f"no gRPC status code {number}")


class Behaviour:
    def __init__(self, args, context):
        md = metadata_dict(context.invocation_metadata())
        self.status = int(md.get("x-test-status", args.status))
        self.delay = int(md.get("x-test-delay-ms", args.delay_ms)) / 1000.0
        self.headers_first = md.get("x-test-headers-first") == "1"
        self.messages = int(md.get("x-test-messages", "100"))

    def fail(self, context):
        """Ends the call with the configured status if it is not OK; returns False if it is."""
        if self.status == 0:
            return False
        if self.headers_first:
            context.send_initial_metadata((("x-test-phase", "headers-first"),))
        context.abort(code_of(self.status), f"peer.py: status {self.status} as asked")
        return True


def sleep_unless_cancelled(context, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not context.is_active():
            return False
        time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))
    return True


def serve(args):
    counts = Counts()

    def counted(method, body):
        def handler(request, context):
            counts.start(method)
            return body(request, context)
        return handler

    def unary(request, context):
        b = Behaviour(args, context)
        if not sleep_unless_cancelled(context, b.delay):
            return b""
        if b.fail(context):
            return b""
        return request

    def upload(request_iterator, context):
        b = Behaviour(args, context)
        n = 0
        for _ in request_iterator:
            n += 1
        if not sleep_unless_cancelled(context, b.delay):
            return b""
        if b.fail(context):
            return b""
        return str(n).encode()

    def watch(request, context):
        counts.start("Watch")
        b = Behaviour(args, context)
        if b.fail(context):
            return
        for i in range(b.messages):
            if not sleep_unless_cancelled(context, b.delay):
                return
            yield str(i).encode()

    def stats(request, context):
        return json.dumps(counts.snapshot()).encode()

    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(counted("Unary", unary)),
        "Upload": grpc.stream_unary_rpc_method_handler(counted("Upload", upload)),
        "Watch": grpc.unary_stream_rpc_method_handler(watch),
        "Stats": grpc.unary_unary_rpc_method_handler(stats),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=256),
                         options=[("grpc.so_reuseport", 0), ("grpc.max_concurrent_streams", 1000)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(json.dumps({"port": port}), flush=True)

    stopped = threading.Event()

    def on_term(signum, frame):
        threading.Thread(target=lambda: (server.stop(args.grace_ms / 1000.0).wait(), stopped.set()),
                         daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    if args.watch_stdin:
        threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    while not stopped.wait(0.2):
        pass
    print(json.dumps({"stopped": True}), flush=True)


# ------------------------------------------------------------------------------------------
# Client
# ------------------------------------------------------------------------------------------


def parse_metadata(pairs):
    out = []
    for pair in pairs or ():
        key, _, value = pair.partition("=")
        out.append((key, value))
    return tuple(out)


def channel_for(args):
    options = [("grpc.enable_retries", 0)]
    if getattr(args, "service_config", None):
        options = [("grpc.enable_retries", 1), ("grpc.service_config", args.service_config)]
    return grpc.insecure_channel(args.target, options=options)


def outcome_of(error_or_call, started, code=None):
    """One finished call: its code, details, metadata and how long it took."""
    elapsed_ms = round((time.monotonic() - started) * 1000.0, 1)
    call = error_or_call
    try:
        code = code or call.code()
        details = call.details()
        initial = metadata_dict(call.initial_metadata())
        trailing = metadata_dict(call.trailing_metadata())
    except Exception as e:  # a future cancelled before it started has little to say
        return {"code": (code.name if code else "UNKNOWN"), "details": str(e), "initial": {},
                "trailing": {}, "elapsed_ms": elapsed_ms}
    return {"code": code.name, "details": details, "initial": initial, "trailing": trailing,
            "elapsed_ms": elapsed_ms}


def summary(results):
    codes = {}
    for r in results:
        codes[r["code"]] = codes.get(r["code"], 0) + 1
    return {"codes": codes, "calls": results}


def call(args):
    channel = channel_for(args)
    method = channel.unary_unary(f"/{SERVICE}/{args.method}")
    metadata = parse_metadata(args.metadata)
    timeout = args.timeout_ms / 1000.0 if args.timeout_ms else 30.0
    results = []
    lock = threading.Lock()

    def one(_):
        started = time.monotonic()
        try:
            _, c = method.with_call(args.payload.encode(), metadata=metadata, timeout=timeout)
            r = outcome_of(c, started)
        except grpc.RpcError as e:
            r = outcome_of(e, started)
        with lock:
            results.append(r)

    with futures.ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        list(pool.map(one, range(args.n)))
    channel.close()
    print(json.dumps(summary(results)))


def results_of(calls):
    """Waits for every (future, started) pair; returns what each call ended with."""
    results = []
    for f, started in calls:
        try:
            f.result(timeout=30.0)
            results.append(outcome_of(f, started))
        except grpc.FutureCancelledError:
            results.append(outcome_of(f, started, grpc.StatusCode.CANCELLED))
        except grpc.RpcError as e:
            results.append(outcome_of(e, started))
    return results


def cancel(args):
    channel = channel_for(args)
    metadata = parse_metadata(args.metadata)
    wait = args.after_ms / 1000.0
    if args.kind == "unary":
        method = channel.unary_unary(f"/{SERVICE}/Unary")
        calls = [(method.future(b"x", metadata=metadata, timeout=30.0), time.monotonic()) for _ in range(args.n)]
        time.sleep(wait)
        for f, _ in calls:
            f.cancel()
        results = results_of(calls)
    elif args.kind == "upload":
        method = channel.stream_unary(f"/{SERVICE}/Upload")
        release = threading.Event()
        sent = threading.Semaphore(0)

        def requests():
            yield b"first"
            sent.release()
            release.wait(30.0)  # never finishes the request before being cancelled
            yield b"late"

        calls = [(method.future(requests(), metadata=metadata, timeout=30.0), time.monotonic()) for _ in range(args.n)]
        for _ in range(args.n):
            sent.acquire(timeout=30.0)
        time.sleep(wait)
        for f, _ in calls:
            f.cancel()
        release.set()
        results = results_of(calls)
    else:
        method = channel.unary_stream(f"/{SERVICE}/Watch")
        streams = [(method(b"x", metadata=metadata, timeout=30.0), time.monotonic()) for _ in range(args.n)]
        for s, _ in streams:
            next(s)  # one message in: the response has started
        time.sleep(wait)
        for s, _ in streams:
            s.cancel()
        results = []
        for s, started in streams:
            try:
                for _ in s:
                    pass
                results.append(outcome_of(s, started))
            except grpc.RpcError as e:
                results.append(outcome_of(e, started))
    channel.close()
    print(json.dumps(summary(results)))


def close(args):
    channel = channel_for(args)
    method = channel.unary_unary(f"/{SERVICE}/Unary")
    metadata = parse_metadata(args.metadata)
    calls = [(method.future(b"x", metadata=metadata, timeout=30.0), time.monotonic()) for _ in range(args.n)]
    time.sleep(args.after_ms / 1000.0)
    channel.close()
    print(json.dumps(summary(results_of(calls))))


def stats(args):
    with grpc.insecure_channel(args.target) as channel:
        answer = channel.unary_unary(f"/{SERVICE}/Stats")(b"", timeout=10.0)
    print(answer.decode())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--status", type=int, default=0)
    s.add_argument("--delay-ms", type=int, default=0)
    s.add_argument("--grace-ms", type=int, default=500)
    s.add_argument("--watch-stdin", action="store_true")
    for name in ("call", "cancel", "close"):
        c = sub.add_parser(name)
        c.add_argument("target")
        c.add_argument("--n", type=int, default=1)
        c.add_argument("--metadata", action="append")
        if name == "call":
            c.add_argument("--method", default="Unary")
            c.add_argument("--concurrency", type=int, default=1)
            c.add_argument("--timeout-ms", type=int, default=0)
            c.add_argument("--payload", default="hello")
            c.add_argument("--service-config")
        else:
            c.add_argument("--after-ms", type=int, default=200)
        if name == "cancel":
            c.add_argument("--kind", choices=["unary", "upload", "watch"], required=True)
    st = sub.add_parser("stats")
    st.add_argument("target")
    args = parser.parse_args()
    {"serve": serve, "call": call, "cancel": cancel, "close": close, "stats": stats}[args.command](args)


if __name__ == "__main__":
    main()
