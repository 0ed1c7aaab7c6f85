"""HttpPolicy against a fake OpenAI-compatible server on loopback, and a hostile one."""

import asyncio
import http.server
import json
import logging
import socket
import socketserver
import threading
import time

import pytest

from mars_jax.agents.http_policy import HttpPolicy
from mars_jax.agents.policy import ChatRequest


class _Loopback:
    """Serves `server` on 127.0.0.1 from a thread while in a `with` block."""

    def _serve(self, server: socketserver.TCPServer) -> None:
        server.daemon_threads = True
        self.server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        self.thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


class FakeServer(_Loopback):
    """Answers /v1/chat/completions; `plans[content]` lists what to do on each attempt for that user content.

    A plan step is "ok", "length", "think", ("sleep", seconds), or an HTTP status code (int).
    """

    def __init__(self, plans=None, delay=0.0):
        self.plans = {k: list(v) for k, v in (plans or {}).items()}
        self.delay = delay
        self.received = []  # (path, headers, body) per attempt
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                content = body["messages"][-1]["content"]
                with fake.lock:
                    fake.received.append((self.path, dict(self.headers), body))
                    plan = fake.plans.get(content) or ["ok"]
                    step = plan.pop(0) if len(plan) > 1 else plan[0]
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    time.sleep(fake.delay)
                    if isinstance(step, tuple):
                        time.sleep(step[1])
                        step = "ok"
                finally:
                    # Out of flight before the reply leaves: once the client has it, it may
                    # send its next request before this thread would get to run again.
                    with fake.lock:
                        fake.in_flight -= 1
                try:
                    if isinstance(step, int):
                        self.send_error(step, "planned failure")
                        return
                    message = {"role": "assistant", "content": f"echo {content}"}
                    if step == "think":
                        message["reasoning_content"] = "pondering"
                    reply = {"choices": [{"index": 0, "message": message,
                                          "finish_reason": "length" if step == "length" else "stop"}],
                             "usage": {"prompt_tokens": 5, "completion_tokens": len(content)}}
                    data = json.dumps(reply).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and went away

        self._serve(http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler))

    def attempts(self, content):
        return sum(body["messages"][-1]["content"] == content for _, _, body in self.received)


def req(content, role="solver", max_new_tokens=16):
    return ChatRequest(({"role": "system", "content": "be brief"}, {"role": "user", "content": content}),
                       role, max_new_tokens)


def policy(url, **kwargs):
    defaults = dict(temperature=0.6, top_p=0.95, timeout_s=5.0, max_retries=2, max_concurrency=4, backoff_s=0.01)
    return HttpPolicy(url, "qwen3", **{**defaults, **kwargs})


def test_batch_is_completed_in_order_with_the_request_fields():
    with FakeServer({"b": ["length"], "c": ["think"]}) as server:
        out = policy(server.url + "/", api_key="sk-test", extra_body={"top_k": 20, "temperature": 0.1}).complete(
            [req("a"), req("b", "verifier", 32), req("c")])
    assert [(c.text, c.finish_reason, c.num_tokens) for c in out] == [
        ("echo a", "stop", 1), ("echo b", "length", 1), ("<think>\npondering\n</think>\n\necho c", "stop", 1)]
    bodies = {body["messages"][-1]["content"]: body for _, _, body in server.received}
    path, headers, _ = server.received[0]
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer sk-test"
    assert bodies["b"] == {"model": "qwen3", "messages": [{"role": "system", "content": "be brief"},
                                                          {"role": "user", "content": "b"}],
                           "max_tokens": 32, "temperature": 0.1, "top_p": 0.95, "top_k": 20}


def test_concurrency_is_bounded():
    with FakeServer(delay=0.1) as server:
        out = policy(server.url, max_concurrency=2).complete([req(str(i)) for i in range(6)])
    assert [c.text for c in out] == [f"echo {i}" for i in range(6)]
    assert server.max_in_flight == 2


def test_500_is_retried_then_succeeds():
    with FakeServer({"x": [500, 503, "ok"]}) as server:
        [out] = policy(server.url).complete([req("x")])
    assert (out.text, out.finish_reason) == ("echo x", "stop")
    assert server.attempts("x") == 3


def test_persistent_500_gives_an_error_completion_and_a_warning(caplog):
    with FakeServer({"x": [500]}) as server, caplog.at_level(logging.WARNING):
        a, b = policy(server.url, max_retries=1).complete([req("x"), req("y")])
    assert (a.text, a.finish_reason, a.num_tokens) == ("", "error", 0)
    assert (b.text, b.finish_reason) == ("echo y", "stop")  # one bad request spoils nothing else
    assert server.attempts("x") == 2
    assert "HTTP 500" in caplog.text and "2 attempt" in caplog.text


def test_4xx_is_not_retried_but_429_is():
    with FakeServer({"bad": [400], "busy": [429, "ok"]}) as server:
        bad, busy = policy(server.url).complete([req("bad"), req("busy")])
    assert bad.finish_reason == "error" and server.attempts("bad") == 1
    assert busy.finish_reason == "stop" and server.attempts("busy") == 2


def test_timeout_is_retried():
    # A 1 s reply would be an answer if the 0.2 s timeout were ignored: "stuck" would not fail.
    with FakeServer({"slow": [("sleep", 1.0), "ok"], "stuck": [("sleep", 1.0)]}) as server:
        slow, stuck = policy(server.url, timeout_s=0.2, max_retries=1).complete([req("slow"), req("stuck")])
    assert (slow.text, slow.finish_reason) == ("echo slow", "stop")
    assert stuck.finish_reason == "error" and server.attempts("stuck") == 2


def test_connection_refused_gives_an_error_completion():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    [out] = policy(f"http://127.0.0.1:{port}/v1", max_retries=1).complete([req("x")])
    assert out.finish_reason == "error"


def test_empty_batch_and_bad_arguments():
    assert policy("http://127.0.0.1:9/v1").complete([]) == []
    with pytest.raises(ValueError):
        policy("http://127.0.0.1:9/v1", max_concurrency=0)


class _ThreadingServer(socketserver.ThreadingTCPServer):
    request_queue_size = 64  # every request of a batch connects at once


class HostileServer(_Loopback):
    """A raw-socket HTTP server that answers each request by the behaviour its user content
    names (`BEHAVIOURS`), sending bytes as they are, however broken or slow."""

    CHUNK = b"x" * (64 << 10)  # a 200 MB body is sent as this block over and over

    def __init__(self):
        hostile = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    byte = self.rfile.read(1)
                    if not byte:
                        return
                    head += byte
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                content = json.loads(self.rfile.read(length))["messages"][-1]["content"]
                try:
                    getattr(hostile, content)(self.wfile)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up, as it should

        self._serve(_ThreadingServer(("127.0.0.1", 0), Handler))

    @staticmethod
    def _json(out, reply, status=b"200 OK"):
        data = json.dumps(reply).encode()
        out.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(data)).encode() + b"\r\nConnection: close\r\n\r\n"
                  + data)

    @staticmethod
    def _ok(**message):
        return {"choices": [{"message": {"role": "assistant", "content": "fine", **message},
                             "finish_reason": "stop"}], "usage": {"completion_tokens": 3}}

    def list_message(self, out):
        self._json(out, {"choices": [{"message": ["fine"], "finish_reason": "stop"}]})

    def list_usage(self, out):
        self._json(out, {**self._ok(), "usage": [3]})

    def number_content(self, out):
        self._json(out, self._ok(content=123))

    def list_choices_entry(self, out):
        self._json(out, {"choices": ["fine"], "usage": {"completion_tokens": 3}})

    def not_json(self, out):
        out.write(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\nConnection: close\r\n\r\n"
                  b"\xff\xfe{oops}!")

    def nested_json(self, out):
        data = b"[" * 200_000 + b"]" * 200_000
        out.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data) + data)

    def not_http(self, out):
        out.write(b"SMTP ready\r\n\r\n")

    def stalled_500_body(self, out):
        out.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 1000\r\n\r\npartial")
        out.flush()
        time.sleep(10)

    def byte_every_half_second(self, out):
        data = json.dumps(self._ok()).encode()
        response = (b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(data)).encode()
                    + b"\r\n\r\n" + data)
        for i in range(len(response)):
            out.write(response[i:i + 1])
            out.flush()
            time.sleep(0.5)

    def _body_200_mb(self, out, header):
        out.write(b"HTTP/1.1 200 OK\r\n" + header + b"\r\n")
        for _ in range((200 << 20) // len(self.CHUNK)):
            out.write(self.CHUNK if b"chunked" not in header else
                      b"%x\r\n" % len(self.CHUNK) + self.CHUNK + b"\r\n")

    def body_200_mb_declared(self, out):
        self._body_200_mb(out, b"Content-Length: %d\r\n" % (200 << 20))

    def body_200_mb_chunked(self, out):
        self._body_200_mb(out, b"Transfer-Encoding: chunked\r\n")


HOSTILE = ("list_message", "list_usage", "number_content", "list_choices_entry", "not_json",
           "nested_json", "not_http", "stalled_500_body", "byte_every_half_second",
           "body_200_mb_declared", "body_200_mb_chunked")


def test_anything_a_hostile_server_sends_is_an_error_completion_within_the_deadline(caplog):
    """Each request gets one attempt of at most timeout_s = 1 s; a 1 s deadline that bounded
    only each read would let the trickling reply run for its whole length (~60 s)."""
    with HostileServer() as server, caplog.at_level(logging.WARNING):
        start = time.monotonic()
        out = policy(server.url, timeout_s=1.0, max_retries=0, reconnect_s=0.0,
                     max_concurrency=len(HOSTILE), max_body_bytes=1 << 20).complete(
            [req(behaviour) for behaviour in HOSTILE])
        elapsed = time.monotonic() - start
    assert [(c.text, c.finish_reason, c.num_tokens) for c in out] == [("", "error", 0)] * len(
        HOSTILE)
    assert elapsed < 5.0, elapsed  # the stalled body waits 10 s, the trickle takes ~60 s
    for words in ("choices[0].message is list, not dict", "usage is list, not dict",
                  "choices[0].message.content is int, not str", "choices[0] is not an object",
                  "reply is not JSON: UnicodeDecodeError", "reply is not JSON: RecursionError",
                  "HTTP 500: no complete reply within timeout_s=1",
                  "RemoteProtocolError", "no complete reply within timeout_s=1",
                  f"reply of {200 << 20} bytes exceeds max_body_bytes=1048576",
                  "reply exceeds max_body_bytes=1048576"):
        assert words in caplog.text
    assert "Traceback" not in caplog.text


def test_a_reply_within_the_body_cap_is_read():
    with FakeServer() as server:
        [out] = policy(server.url, max_body_bytes=4096).complete([req("a")])
    assert (out.text, out.finish_reason) == ("echo a", "stop")


def test_complete_runs_inside_a_running_event_loop():
    """A notebook's thread already runs an event loop: the batch runs on one of its own."""
    async def caller(url):
        return policy(url).complete([req("a")])

    with FakeServer() as server:
        [out] = asyncio.run(caller(server.url))
    assert out.text == "echo a"


@pytest.mark.parametrize("variable, key", [("OPENAI_API_KEY", "sk-env"), ("MY_SERVER_KEY", "k2"),
                                           ("", None)])
def test_the_eval_job_sends_the_key_in_the_configured_variable(variable, key, monkeypatch):
    from experiments.configs import eval_system
    from mars_jax import config_diff, eval_job
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    monkeypatch.setenv("MY_SERVER_KEY", "k2")
    with FakeServer() as server:
        config = eval_system.get_config()
        config.eval.policy, config.eval.served_model = "http", "qwen3"
        config.eval.vc_base_url, config.eval.api_key_env = server.url, variable
        [out] = eval_job.build_policy(config).complete([req("a")])
    assert out.text == "echo a"
    [(_, headers, _)] = server.received
    assert headers.get("Authorization") == (f"Bearer {key}" if key else None)
    assert "sk-env" not in json.dumps(config_diff.record(config))  # the key is never recorded
