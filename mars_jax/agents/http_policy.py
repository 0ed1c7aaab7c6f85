"""A policy served over an OpenAI-compatible `/v1/chat/completions` endpoint (vLLM, SGLang).

Each attempt is bounded as a whole by `timeout_s` (httpx asyncio: a socket timeout bounds each read
only) and reads at most `max_body_bytes`. Timeouts, connection errors, 429 and 5xx are retried with
backoff, a restarting server for up to `reconnect_s`. A request that still fails yields
`finish_reason='error'`, never an exception, so one bad request cannot kill an evaluation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from collections.abc import Coroutine
from typing import Any, Mapping, Sequence

import httpx

from mars_jax.agents.policy import ChatRequest, Completion

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
MAX_BODY_BYTES = 8 << 20  # a reply of 100k tokens of text is ~0.5 MB
_FINISH_REASONS = {"stop": "stop", "length": "length"}
_ERROR_SNIPPET = 500  # bytes of an error status's body put in the warning


class _Retryable(Exception):
    """A failure worth trying again (timeout, connection error, 429, 5xx)."""


class _Unreachable(_Retryable):
    """The server is down or restarting: connection refused, reset or dropped."""


class _Fatal(Exception):
    """A failure that another attempt would repeat (4xx other than 429, not a chat completion)."""


class HttpPolicy:
    """OpenAI-compatible chat-completions client; `base_url` includes the API prefix,
    `extra_body` fields are merged into every request."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, temperature: float,
                 top_p: float, timeout_s: float = 600.0, max_retries: int = 3, max_concurrency: int = 32,
                 extra_body: Mapping[str, Any] | None = None, backoff_s: float = 1.0,
                 reconnect_s: float = 600.0, max_body_bytes: int = MAX_BODY_BYTES):
        if (max_concurrency < 1 or max_retries < 0 or not timeout_s > 0 or reconnect_s < 0
                or max_body_bytes < 1):
            raise ValueError("need max_concurrency >= 1, max_retries >= 0, timeout_s > 0, "
                             "reconnect_s >= 0 and max_body_bytes >= 1")
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
        self._max_body_bytes = max_body_bytes
        self._reached = False  # the server has answered at least once

    def complete(self, requests: Sequence[ChatRequest]) -> list[Completion]:
        if not requests:
            return []
        return _run(self._complete_all(requests))

    async def _complete_all(self, requests: Sequence[ChatRequest]) -> list[Completion]:
        slots = asyncio.Semaphore(self._max_concurrency)
        limits = httpx.Limits(max_connections=self._max_concurrency)
        async with httpx.AsyncClient(headers=self._headers, limits=limits, timeout=None) as client:
            async def one(request: ChatRequest) -> Completion:
                async with slots:
                    return await self._complete_one(client, request)
            return list(await asyncio.gather(*map(one, requests)))

    async def _complete_one(self, client: httpx.AsyncClient, request: ChatRequest) -> Completion:
        body = json.dumps({
            "model": self.model,
            "messages": list(request.messages),
            "max_tokens": request.max_new_tokens,
            **self._sampling,
            **self._extra_body,
        }).encode()
        loop = asyncio.get_running_loop()
        error, retries, down_since, attempt = "", 0, None, 0
        while True:
            try:
                return _parse_reply(await self._post(client, body))
            except _Unreachable as e:
                error = str(e)
                if self._reached:  # it went away: wait for it to come back
                    down_since = loop.time() if down_since is None else down_since
                    if loop.time() - down_since >= self._reconnect_s:
                        break
                else:
                    retries += 1
            except _Retryable as e:
                error, retries = str(e), retries + 1
            except _Fatal as e:
                error = f"not retried: {e}"
                break
            if retries > self._max_retries:
                break
            attempt += 1
            await asyncio.sleep(min(self._backoff_s * 2 ** min(attempt - 1, 30), MAX_BACKOFF_S))
        log.warning("%s request to %s failed after %d attempt(s): %s",
                    request.role, self.url, attempt + 1, error)
        return Completion(text="", finish_reason="error", num_tokens=0)

    async def _post(self, client: httpx.AsyncClient, body: bytes) -> Any:
        """One HTTP attempt within `timeout_s`: the reply's JSON, or `_Retryable` / `_Fatal`."""
        status = None
        try:
            async with asyncio.timeout(self._timeout_s):
                async with client.stream("POST", self.url, content=body) as response:
                    self._reached, status = True, response.status_code
                    if status != 200:
                        raise _status_error(status, await _read(response, _ERROR_SNIPPET,
                                                                truncate=True))
                    data = await _read(response, self._max_body_bytes)
        except TimeoutError as e:
            late = f"no complete reply within timeout_s={self._timeout_s:g}"
            raise (_Retryable(late) if status in (None, 200)
                   else _status_error(status, late.encode())) from e
        except (httpx.ConnectError, httpx.ReadError, httpx.WriteError) as e:
            raise _Unreachable(repr(e)) from e
        except httpx.RemoteProtocolError as e:  # dropped mid-request, or not speaking HTTP
            if "disconnected" in str(e):
                raise _Unreachable(repr(e)) from e
            raise _Retryable(repr(e)) from e
        except httpx.HTTPError as e:
            raise _Retryable(repr(e)) from e
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as e:  # undecodable bytes, nesting too deep
            raise _Fatal(f"reply is not JSON: {e!r}") from e


async def _read(response: httpx.Response, limit: int, *, truncate: bool = False) -> bytes:
    """The decoded body up to `limit` bytes: cut there with `truncate`, else `_Fatal` if longer."""
    declared = response.headers.get("content-length", "")
    if not truncate and declared.isdigit() and int(declared) > limit:
        raise _Fatal(f"reply of {declared} bytes exceeds max_body_bytes={limit}")
    data = bytearray()
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) > limit:
            if truncate:
                break
            raise _Fatal(f"reply exceeds max_body_bytes={limit}")
    return bytes(data[:limit])


def _status_error(code: int, snippet: bytes) -> Exception:
    message = f"HTTP {code}: {snippet.decode(errors='replace')}"
    return _Retryable(message) if code == 429 or code >= 500 else _Fatal(message)


def _run(coroutine: Coroutine) -> Any:
    """`coroutine`'s result on a new event loop (in a worker thread if one already runs here)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _parse_reply(reply: Any) -> Completion:
    """Maps a chat-completions reply to a `Completion` (`_Fatal` for other JSON); reasoning
    returned separately is put back in front of the content inside <think> tags."""
    choices = _typed(reply, "choices", list, "reply")
    choice = choices[0] if choices else None
    message = _typed(choice, "message", dict, "choices[0]")
    text = _typed(message, "content", str, "choices[0].message", optional=True) or ""
    reasoning = (_typed(message, "reasoning_content", str, "choices[0].message", optional=True)
                 or _typed(message, "reasoning", str, "choices[0].message", optional=True))
    if reasoning:
        text = f"<think>\n{reasoning}\n</think>\n\n{text}"
    reason = choice.get("finish_reason")
    if reason not in _FINISH_REASONS:
        log.warning("unexpected finish_reason %r, treated as an error", reason)
    usage = _typed(reply, "usage", dict, "reply", optional=True) or {}
    tokens = _typed(usage, "completion_tokens", int, "usage", optional=True) or 0
    return Completion(text=text, finish_reason=_FINISH_REASONS.get(reason, "error"),
                      num_tokens=tokens)


def _typed(parent: Any, key: str, kind: type, where: str, *, optional: bool = False) -> Any:
    """`parent[key]` when `parent` is an object and the value a `kind` (not a bool for int);
    None when `optional` and it is absent or null; else `_Fatal`."""
    if not isinstance(parent, dict):
        raise _Fatal(f"not a chat completion: {where} is not an object")
    value = parent.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _Fatal(f"not a chat completion: {where}.{key} is {type(value).__name__}, "
                     f"not {kind.__name__}")
    return value
