"""The completions and chat handlers: prompt checks, engine requests, JSON or SSE answers.

Each HTTP request becomes one engine request per prompt. A client that goes away (a
non-streaming one while it waits, a streaming one at any time) aborts its requests at
once, which frees their KV cache.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from speculum.errors import EngineDeadError, RequestError
from speculum.sampling import sample_params
from speculum.server import protocol as P
from speculum.server.async_engine import AsyncEngine, EngineStepError, EngineStoppedError, EngineUpdate, RequestStream
from speculum.server.detokenize import IncrementalDetokenizer
from speculum.server.errors import APIError, error_body
from speculum.server.spec_report import speculative_decoding_report
from speculum.tokenizer import Tokenizer

log = logging.getLogger("speculum.server")


class OpenAIServing:
    """Answers ``/v1/completions`` and ``/v1/chat/completions`` for one engine."""

    def __init__(self, engine: AsyncEngine, model_names: list[str], tokenizer: Tokenizer, max_model_len: int,
                 spec_metrics_level: str = "none"):
        self.engine = engine
        self.model_names = list(model_names)
        self.tokenizer = tokenizer  # the server's own copy: the engine thread uses the engine's
        self.max_model_len = max_model_len
        self.spec_metrics_level = spec_metrics_level

    # -- checks -----------------------------------------------------------------------
    def check_model(self, name: str | None) -> str:
        if name is None or name in self.model_names:
            return self.model_names[0] if name is None else name
        raise APIError(f"The model {name!r} does not exist; this server serves {self.model_names[0]!r} "
                       "(GET /v1/models lists the names).", 404, param="model", code="model_not_found")

    def _encode(self, fn, *args) -> list[int]:
        try:
            return fn(*args)
        except RequestError as exc:
            raise APIError(str(exc), param="prompt") from exc

    def _check_length(self, n_prompt: int, max_tokens: int | None, param: str) -> int:
        """Return max_tokens (defaulting to the rest of the context) or raise a clear 400."""
        L = self.max_model_len
        if n_prompt >= L:
            raise APIError(f"This model's maximum context length is {L} tokens, but the prompt has {n_prompt} "
                           f"tokens; shorten the prompt to at most {L - 1} tokens.", param=param,
                           code="context_length_exceeded")
        if max_tokens is None:
            return L - n_prompt
        if n_prompt + max_tokens > L:
            raise APIError(f"This model's maximum context length is {L} tokens, but {n_prompt + max_tokens} were "
                           f"requested ({n_prompt} in the prompt, {max_tokens} for the completion); set max_tokens "
                           f"to at most {L - n_prompt} or shorten the prompt.", param="max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    # -- routes -------------------------------------------------------------------------
    async def completions(self, req: P.CompletionRequest, raw: Request):
        arrival = time.perf_counter()
        model = self.check_model(req.model)
        jobs = []
        for p in req.prompts():
            if isinstance(p, str):
                ids = self._encode(self.tokenizer.encode, p)
                text = p
            else:
                ids, text = list(p), None
            max_tokens = self._check_length(len(ids), req.max_tokens, "prompt")
            jobs += _samples({"prompt_token_ids": ids, "prompt": text}, ids, _params(req, max_tokens))
        return await self._serve("completion", f"cmpl-{uuid.uuid4().hex}", model, req, jobs, raw, arrival)

    async def chat(self, req: P.ChatCompletionRequest, raw: Request):
        arrival = time.perf_counter()
        model = self.check_model(req.model)
        messages = [m.as_template_message() for m in req.messages]
        ids = self._encode(self.tokenizer.apply_chat_template, messages)
        max_tokens = self._check_length(len(ids), req.requested_max_tokens, "messages")
        jobs = _samples({"prompt_token_ids": ids, "prompt": None}, ids, _params(req, max_tokens))
        return await self._serve("chat", f"chatcmpl-{uuid.uuid4().hex}", model, req, jobs, raw, arrival)

    # -- the common path --------------------------------------------------------------
    async def _serve(self, kind: str, rid: str, model: str, req, jobs: list, raw: Request, arrival: float):
        if req.stream and req.samples > req.n:
            raise APIError(f"best_of ({req.samples}) > n ({req.n}) cannot stream: the best samples are known "
                           "only at the end; set stream to false or leave best_of unset", param="best_of")
        added = await asyncio.gather(*(
            self.engine.add_request(f"{rid}-{i}", prompt, params, stream=req.stream, num_prompt_tokens=len(ids),
                                    arrival=arrival)
            for i, (prompt, ids, params, _j) in enumerate(jobs)), return_exceptions=True)
        streams: list[RequestStream] = [s for s in added if isinstance(s, RequestStream)]
        failed = [e for e in added if not isinstance(e, RequestStream)]
        if failed:  # one prompt of the request was refused: the others go too
            self._abort_unfinished(streams)
            if not isinstance(failed[0], Exception):
                raise failed[0]
            raise _as_api_error(failed[0])
        prompt_ids = [ids for _, ids, _, _ in jobs]
        if req.stream:
            cleanup = BackgroundTask(self._abort_unfinished, streams)
            return StreamingResponse(self._stream(kind, rid, model, req, streams, prompt_ids),
                                     media_type="text/event-stream", background=cleanup,
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(kind, rid, model, req, streams, prompt_ids, raw)

    def _abort_unfinished(self, streams: list[RequestStream]) -> None:
        for s in streams:
            if not s.finished:
                self.engine.abort(s.request_id)

    async def _complete(self, kind, rid, model, req, streams, prompt_ids, raw: Request):
        """Wait for every final output, or for the client to leave (then abort)."""
        waiter = asyncio.ensure_future(asyncio.gather(*(_final(s) for s in streams)))
        watcher = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not waiter.done():
                waiter.cancel()
            self._abort_unfinished(streams)
        if waiter not in done:
            log.debug("client of %s disconnected; aborted", rid)
            return JSONResponse(error_body("client disconnected"), status_code=499)
        finals: list[EngineUpdate] = waiter.result()
        for u in finals:
            if u.kind == "error":
                raise _as_api_error(u.error)
        per = req.samples
        choices, n_prompt, n_out = [], 0, 0
        decode = self._decode_one
        for p in range(len(finals) // per):
            group = list(zip(finals[p * per:(p + 1) * per], range(per)))
            n_prompt += group[0][0].num_prompt_tokens  # a prompt counts once, whatever n is
            n_out += sum(u.num_output_tokens for u, _ in group)
            if per > req.n:  # best_of: the n samples with the highest cumulative logprob
                group = sorted(group, key=lambda g: (-(g[0].cumulative_logprob or 0.0), g[1]))[: req.n]
            for j, (u, _) in enumerate(group):
                i, ids = p * req.n + j, prompt_ids[p * per]
                ids_out = u.token_ids or []
                text = u.text if u.text is not None else self.tokenizer.decode(ids_out)
                tok = ids_out if req.return_token_ids else None
                pids = ids if req.return_token_ids else None
                lps = self._logprobs_json(kind, req, u.logprobs) if u.logprobs is not None and \
                    req.top_logprobs_n is not None else None
                if kind == "chat":
                    choices.append(P.chat_choice(i, text, u.finish_reason, tok, pids, lps))
                else:
                    choices.append(P.completion_choice(i, text, u.finish_reason, tok, pids, lps,
                                                       P.prompt_logprobs_json(u.prompt_logprobs)))
        metrics = self._metrics_obj(finals)
        make = P.chat_response if kind == "chat" else P.completion_response
        body = make(rid, model, choices, P.usage(n_prompt, n_out), metrics)
        if kind == "chat" and req.prompt_logprobs is not None:
            body["prompt_logprobs"] = P.prompt_logprobs_json(finals[0].prompt_logprobs)
        return JSONResponse(body)

    def _decode_one(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer.hf is not None else \
            f"token_id:{ids[0]}"

    def _logprobs_json(self, kind: str, req, entries: list, offset: int = 0) -> dict:
        if kind == "chat":
            return P.chat_logprobs(entries, self._decode_one, req.top_logprobs or 0)
        return P.completion_logprobs(entries, self._decode_one, req.logprobs or 0, offset)

    def _metrics_obj(self, finals: list[EngineUpdate]) -> dict | None:
        if self.spec_metrics_level == "none":
            return None
        if len(finals) != 1:  # like vLLM: reported for single-sequence requests only
            return {"speculative_decoding": None}
        u = finals[0]
        return {"speculative_decoding": speculative_decoding_report(u.metrics, u.steps, self.spec_metrics_level)}

    async def _stream(self, kind, rid, model, req, streams: list[RequestStream], prompt_ids) -> AsyncIterator[str]:
        created = int(time.time())
        detoks = [IncrementalDetokenizer(self.tokenizer.decode, req.stop_list) for _ in streams]
        offsets = [0] * len(streams)  # text offset of each choice (completions logprobs)
        finals: list[EngineUpdate | None] = [None] * len(streams)

        def chunk(choices, usage_=None, metrics=None) -> str:
            make = P.chat_chunk if kind == "chat" else P.completion_chunk
            return _sse(make(rid, model, created, choices, usage_, metrics))

        try:
            if kind == "chat":
                yield chunk([P.chat_chunk_choice(i, {"role": "assistant", "content": ""}, None)
                             for i in range(len(streams))])
            async for i, u in _merge(streams):
                if u.kind == "error":
                    yield _sse(_as_api_error(u.error).body())
                    break
                tok = list(u.new_token_ids) if req.return_token_ids else None
                lps = None
                if u.new_logprobs and req.top_logprobs_n is not None:
                    lps = self._logprobs_json(kind, req, u.new_logprobs, offsets[i])
                    offsets[i] += sum(len(t) for t in lps.get("tokens", []))
                if u.finished:
                    finals[i] = u
                    delta = detoks[i].finish(u.text, u.new_token_ids)
                else:
                    delta = detoks[i].add(u.new_token_ids)
                    if not delta and not tok and not lps:
                        continue
                reason = u.finish_reason if u.finished else None
                metrics = self._metrics_obj([u]) if u.finished and len(streams) == 1 else None
                if kind == "chat":
                    if delta or tok or lps:
                        yield chunk([P.chat_chunk_choice(i, {"content": delta}, None, tok, lps)])
                    if u.finished:
                        yield chunk([P.chat_chunk_choice(i, {}, reason)], metrics=metrics)
                else:
                    yield chunk([P.completion_choice(i, delta, reason, tok, logprobs=lps)], metrics=metrics)
            else:
                if req.include_usage:
                    n_prompt = sum(u.num_prompt_tokens for j, u in enumerate(finals) if u and j % req.n == 0)
                    n_out = sum(u.num_output_tokens for u in finals if u)
                    yield chunk([], P.usage(n_prompt, n_out))
            yield "data: [DONE]\n\n"
        finally:  # the client left (cancelled) or we are done: free what still runs
            self._abort_unfinished(streams)


def _params(req, max_tokens: int):
    try:
        return req.sampling_params(max_tokens)
    except ValueError as exc:
        raise APIError(str(exc)) from exc


def _samples(prompt: dict, ids: list[int], params) -> list[tuple]:
    """One engine request per sample of a prompt (n, or best_of): (prompt, ids, params, index).
    Each sample gets its own seed from the request's (speculum.sampling.sample_params)."""
    n = params.num_samples
    if n == 1:
        return [(prompt, ids, params, 0)]
    return [(prompt, ids, sample_params(params, j), j) for j in range(n)]


async def _final(s: RequestStream) -> EngineUpdate:
    """Wait for the last update of a non-streaming request."""
    while True:
        u = await s.get()
        if u.finished or u.kind == "error":
            return u


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, EngineUpdate]]:
    """Updates of several requests as they come, as (index, update); merges queued updates."""
    if len(streams) == 1:
        s = streams[0]
        while not s.finished:
            yield 0, _coalesce(await s.get(), s)
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream):
        while not s.finished:
            await merged.put((i, await s.get()))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, u = await merged.get()
            if u.finished or u.kind == "error":
                left -= 1
            yield i, u
    finally:
        for t in tasks:
            t.cancel()


def _coalesce(u: EngineUpdate, s: RequestStream) -> EngineUpdate:
    """Fold updates that are already queued into ``u`` (a slow client gets bigger chunks)."""
    while u.kind == "output" and not u.finished:
        nxt = s.get_nowait()
        if nxt is None:
            break
        if nxt.kind != "output":
            return nxt
        nxt.new_token_ids = u.new_token_ids + nxt.new_token_ids
        if u.new_logprobs is not None or nxt.new_logprobs is not None:
            nxt.new_logprobs = (u.new_logprobs or []) + (nxt.new_logprobs or [])
        u = nxt
    return u


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (RequestError, ValueError)):
        return APIError(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), 503, type="server_error", code="engine_dead")
    if isinstance(exc, EngineStoppedError):
        return APIError(str(exc), 503, type="server_error", code="server_shutting_down")
    if isinstance(exc, EngineStepError):
        return APIError(str(exc), 500, type="server_error", code="engine_error")
    log.error("request failed: %r", exc)
    return APIError(f"internal error: {exc!r}", 500, type="server_error", code="internal_error")
