"""Eval robustness: the HTTP policy rides out a server restart mid-evaluation, and `evaluate`
resumes from records.jsonl without repeating finished pairs."""
import http.server
import json
import socket
import threading
import time

import pytest

from mars_jax.agents.eval import EvalProblem, evaluate
from mars_jax.agents.http_policy import HttpPolicy
from mars_jax.agents.system import LoopConfig

PROBLEMS = [EvalProblem(f"p{i}", f"Problem {i}: what is 1 + 1?", "2") for i in range(8)]
CONFIG = LoopConfig(k_accept=1, max_iterations=2, prompt_style="compact",
                    max_new_tokens={"solver": 64, "verifier": 64, "corrector": 64})
REPLIES = {"solver": "1 + 1 = 2, so \\boxed{2}.",
           "verifier": ("**Final Verdict:** fine.\n**List of Findings:** None\n"
                        "**Correctness:** Correct"),
           "corrector": "\\boxed{2}"}


class OpenAIServer:
    """A chat-completions server on `port`. With `crash_at=n`, the n-th request and every later
    one get their connection dropped with no reply, and the server stops listening (a crash)."""

    def __init__(self, port: int, crash_at: int | None = None):
        self.served, self.received = 0, 0
        self.crashing, self.crashed = threading.Event(), threading.Event()
        self.lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.received += 1
                    crash = crash_at is not None and server.received >= crash_at
                if crash:
                    self.close_connection = True
                    if not server.crashing.is_set():
                        server.crashing.set()
                        threading.Thread(target=server.crash).start()
                    return
                messages = body["messages"]
                role = ("verifier" if messages[0]["role"] == "system" else
                        "corrector" if len(messages) == 3 else "solver")
                data = json.dumps({"choices": [{"message": {"content": REPLIES[role]},
                                                "finish_reason": "stop"}],
                                   "usage": {"completion_tokens": 5}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                with server.lock:
                    server.served += 1

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.01,), daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def crash(self) -> None:
        self.stop()
        self.crashed.set()


@pytest.fixture
def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _policy(port: int) -> HttpPolicy:
    return HttpPolicy(f"http://127.0.0.1:{port}/v1", "fake", temperature=0.6, top_p=0.95,
                      timeout_s=10.0, max_retries=1, max_concurrency=4, backoff_s=0.05,
                      reconnect_s=60.0)


def _pairs(path) -> list[tuple[str, int]]:
    return [(r["problem_id"], r["sample"]) for r in map(json.loads, path.read_text().splitlines())]


def test_evaluation_survives_a_server_restart_and_is_not_repeated(tmp_path, port):
    path = tmp_path / "records.jsonl"
    first = OpenAIServer(port, crash_at=10)  # crashes mid-evaluation, with requests in flight
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(zip(("records", "summary"), evaluate(
        PROBLEMS, _policy(port), num_samples=2, config=CONFIG, records_path=str(path),
        max_in_flight=4))), daemon=True)
    thread.start()
    assert first.crashed.wait(60)
    time.sleep(1.0)  # down for a while: new connections are refused
    assert thread.is_alive()  # the evaluation is waiting for the server
    second = OpenAIServer(port)  # restarted on the same port
    thread.join(120)
    second.stop()
    assert not thread.is_alive()

    wanted = [(p.id, s) for p in PROBLEMS for s in range(2)]
    # Requests were dropped by the crash, and each pair's Solver and Verifier answered once.
    assert first.received > first.served > 0 and first.served + second.served == 32
    assert sorted(_pairs(path)) == sorted(wanted)  # every pair once: no duplicate, none lost
    assert all(r["status"] == "accepted" and r["correct"] for r in outcome["records"])
    assert all(s["finish_reason"] == "stop" for r in outcome["records"] for s in r["steps"])

    third = OpenAIServer(port)
    again, summary = evaluate(PROBLEMS, _policy(port), num_samples=2, config=CONFIG,
                              records_path=str(path))
    third.stop()
    assert third.received == 0 and again == outcome["records"] and summary == outcome["summary"]


def test_an_interrupted_evaluation_resumes_without_repeating_finished_pairs(tmp_path, port):
    path = tmp_path / "records.jsonl"
    server = OpenAIServer(port)

    def interrupt(info):
        if info.round == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        evaluate(PROBLEMS, _policy(port), num_samples=2, config=CONFIG, records_path=str(path),
                 max_in_flight=4, on_round=interrupt)
    done = _pairs(path)
    assert 0 < len(done) < 16
    before = server.received
    records, _ = evaluate(PROBLEMS, _policy(port), num_samples=2, config=CONFIG,
                          records_path=str(path))
    server.stop()
    assert server.received - before == 2 * (16 - len(done))  # Solver + Verifier per missing pair
    assert sorted(_pairs(path)) == sorted((p.id, s) for p in PROBLEMS for s in range(2))
    assert [(r["problem_id"], r["sample"]) for r in records] == [
        (p.id, s) for p in PROBLEMS for s in range(2)]
