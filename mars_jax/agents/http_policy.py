"""A policy served over an OpenAI-compatible `/v1/chat/completions` endpoint (vLLM, SGLang).

Standard library only. Requests of a batch run concurrently (at most
`max_concurrency` at a time). Timeouts, connection errors, 429 and 5xx responses
are retried with exponential backoff (at most `MAX_BACKOFF_S` between attempts);
other 4xx responses and malformed replies are not. Server restarts: once the
server has answered, a request that finds it unreachable (connection refused,
reset or dropped mid-request) keeps retrying for up to `reconnect_s` without
using up `max_retries`; a server never reached fails fast, after `max_retries`.
A request that still fails yields `Completion(finish_reason='error')` and a
logged warning, never an exception, so one bad request cannot kill an
evaluation (the system loop treats 'error' like a truncation).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import itertools
import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any, Mapping, Sequence

from mars_jax.agents.policy import ChatRequest, Completion

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
_FINISH_REASONS = {"stop": "stop", "length": "length"}


class _Retryable(Exception):
    """A failure worth trying again (timeout, connection error, 429, 5xx)."""


class _Unreachable(_Retryable):
    """The server is down or restarting: connection refused, reset or dropped."""


class _Fatal(Exception):
    """A failure that another attempt would repeat (4xx other than 429)."""


class HttpPolicy:
    """OpenAI-compatible chat-completions client.

    Args:
      base_url: server root including the API prefix, e.g. "http://localhost:8000/v1".
      model: the served model name.
      api_key: sent as a Bearer token when given.
      temperature, top_p: sampling parameters sent with every request.
      timeout_s: socket timeout of one HTTP attempt; the server answers only when
        generation ends, so this bounds the wait for one completion.
      max_retries: extra attempts after a retryable failure.
      max_concurrency: most requests in flight at once.
      extra_body: extra JSON fields merged into every request body (e.g. top_k,
        chat_template_kwargs); they override the defaults above.
      backoff_s: wait before the first retry; doubled on each further retry.
      reconnect_s: once the server has answered, how long a request keeps
        retrying while the server is unreachable (e.g. restarting).
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, temperature: float,
                 top_p: float, timeout_s: float = 600.0, max_retries: int = 3, max_concurrency: int = 32,
                 extra_body: Mapping[str, Any] | None = None, backoff_s: float = 1.0,
                 reconnect_s: float = 600.0):
        if max_concurrency < 1 or max_retries < 0 or timeout_s <= 0 or reconnect_s < 0:
            raise ValueError("need max_concurrency >= 1, max_retries >= 0, timeout_s > 0 and "
                             "reconnect_s >= 0")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._sampling = {"temperature": temperature, "top_p": top_p}
        self._timeout_s = timeout_s
        self._max_retries = max_retries
        self._max_concurrency = max_concurrency
        self._extra_body = dict(extra_body or {})
        self._backoff_s = backoff_s
        self._reconnect_s = reconnect_s
        self._reached = False  # the server has answered at least once

    def complete(self, requests: Sequence[ChatRequest]) -> list[Completion]:
        if not requests:
            return []
        workers = min(self._max_concurrency, len(requests))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(self._complete_one, requests))

    def _complete_one(self, request: ChatRequest) -> Completion:
        body = json.dumps({
            "model": self.model,
            "messages": list(request.messages),
            "max_tokens": request.max_new_tokens,
            **self._sampling,
            **self._extra_body,
        }).encode()
        error, retries, down_since = "", 0, None
        for attempt in itertools.count():
            if attempt:
                time.sleep(min(self._backoff_s * 2 ** min(attempt - 1, 30), MAX_BACKOFF_S))
            try:
                return _parse_reply(self._post(body))
            except _Unreachable as e:
                error = str(e)
                if self._reached:  # it went away: wait for it to come back
                    down_since = time.monotonic() if down_since is None else down_since
                    if time.monotonic() - down_since < self._reconnect_s:
                        continue
                    break
                retries += 1
            except _Retryable as e:
                error = str(e)
                retries += 1
            except (_Fatal, ValueError, KeyError, IndexError, TypeError) as e:
                error = f"not retried: {e}"
                break
            if retries > self._max_retries:
                break
        log.warning("%s request to %s failed after %d attempt(s): %s",
                    request.role, self.url, attempt + 1, error)
        return Completion(text="", finish_reason="error", num_tokens=0)

    def _post(self, body: bytes) -> dict[str, Any]:
        """One HTTP attempt; raises `_Retryable`, `_Fatal` or a JSON decoding error."""
        http_request = urllib.request.Request(self.url, data=body, headers=self._headers, method="POST")
        try:
            with urllib.request.urlopen(http_request, timeout=self._timeout_s) as response:
                self._reached = True
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            self._reached = True
            message = f"HTTP {e.code}: {e.read()[:500].decode(errors='replace')}"
            if e.code == 429 or e.code >= 500:
                raise _Retryable(message) from e
            raise _Fatal(message) from e
        except (OSError, http.client.HTTPException) as e:  # URLError, timeouts, resets, SSL errors
            if isinstance(e, ConnectionError) or isinstance(getattr(e, "reason", None),
                                                            ConnectionError):
                raise _Unreachable(repr(e)) from e
            raise _Retryable(repr(e)) from e


def _parse_reply(reply: dict[str, Any]) -> Completion:
    """Maps a chat-completions reply to a `Completion`.

    Reasoning returned separately by the server (`reasoning_content` / `reasoning`)
    is put back in front of the content inside <think> tags, as the model wrote it.
    """
    choice = reply["choices"][0]
    message = choice["message"]
    text = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        text = f"<think>\n{reasoning}\n</think>\n\n{text}"
    reason = choice.get("finish_reason")
    if reason not in _FINISH_REASONS:
        log.warning("unexpected finish_reason %r, treated as an error", reason)
    usage = reply.get("usage") or {}
    return Completion(text=text, finish_reason=_FINISH_REASONS.get(reason, "error"),
                      num_tokens=int(usage.get("completion_tokens") or 0))
