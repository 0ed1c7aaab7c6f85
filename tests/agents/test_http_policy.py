"""HttpPolicy against a fake OpenAI-compatible server on loopback."""

import http.server
import json
import logging
import socket
import threading
import time

import pytest

from mars_jax.agents.http_policy import HttpPolicy
from mars_jax.agents.policy import ChatRequest


class FakeServer:
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

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True)

    def attempts(self, content):
        return sum(body["messages"][-1]["content"] == content for _, _, body in self.received)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


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
