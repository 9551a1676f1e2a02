"""`duet serve`: the engine behind a local OpenAI-compatible HTTP endpoint.

    duet serve [--model M] [--host 127.0.0.1] [--port 8080] [--route R] [--accept A] [--draft D] ...

One model is loaded and one request runs at a time: duet is a single-user engine, so requests wait
in arrival order for the one engine thread (`EngineQueue`), and each response says how many were
ahead of it (the `x-duet-queued-ahead` header). Starlette answers HTTP and uvicorn serves it.

Endpoints: GET /v1/models, POST /v1/chat/completions (the model's chat template renders the
messages, as the app does), POST /v1/completions (the prompt as is, as `--raw`); both stream as
server-sent events when asked. Fields a request leaves out take the chat app's settings (the config
file `duet --paths` names). duet's own request fields sit under `duet` (accept, draft, depth, route),
and every final response (the last chunk of a stream) carries `duet`: the engine's finish reason,
the routes and rules that ran and the stats `duet --headless --json` prints. A request that carries
on the last one's conversation (its prompt begins with the last prompt and reply) prefills only
what is new (engine.PromptCache; `cached_tokens` in the stats).

A client that leaves mid-stream cancels its reply at the next cycle; Ctrl-C cancels what runs and
stops the server. `--api-key` (or DUET_API_KEY) asks every request for `Authorization: Bearer KEY`;
the key is never logged or written anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import hmac
import itertools
import json
import os
import queue
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from duet.app.arguments import add_engine_arguments, chat_model_path, engine_choices
from duet.app.session import EngineChoices, reply_options
from duet.app.settings import Config, load_config, user_paths
from duet.engine import (
    Accept, Draft, DuetError, Finished, GenerateOptions, LoadedModel, PromptCache, Route, Stats, Switches, Tokens,
    generate, load_model,
)
from duet.engine.speculative import depth_cap

DEFAULT_PORT = 8080
API_KEY_VARIABLE = "DUET_API_KEY"
LOOPBACK = ("127.0.0.1", "::1", "localhost")
ROLES = ("system", "user", "assistant", "tool")
OPENAI_FINISH = {"stop": "stop", "length": "length", "context": "length"}  # the engine's reasons, in OpenAI's words
MAX_STOP_STRINGS = 16
HISTORY = 64  # ended jobs the engine keeps for a look back (tests, a log)
DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks that its client is still there


class Stopping(DuetError):
    """The server stopped before a queued request ran: answered 503."""


class RequestError(DuetError):
    """A request the server cannot run: answered 400 with an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ------------------------------------------------------------------------------ requests ---

@dataclass
class Job:
    """One request's reply: its prompt and options in, the engine's events out (to the event loop
    that waits for them), and a cancel flag the engine reads at every cycle."""

    prompt_ids: list[int]
    options: GenerateOptions
    switches: Switches
    stop: tuple[str, ...] = ()
    turn_start: int | None = None  # prompt tokens before the reply's opening (engine.generate's)
    cancel: threading.Event = field(default_factory=threading.Event)
    received: int = 0  # arrival order, from 1
    started: int = 0  # order the engine took it up, from 1
    submitted_at: float = 0.0
    waited_s: float = 0.0  # from arrival to the engine taking it up
    finish: str = ""  # the engine's finish reason once it ended; "stop" for a stop string too
    generated_tokens: int = 0
    events: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None

    def put(self, item) -> None:
        """Hand an engine event (or the end, None, or an error) to the request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop has closed: the server is gone, nobody is waiting
            self.cancel.set()


class EngineQueue:
    """The loaded model and the one thread that runs it: jobs run one at a time, in arrival order."""

    def __init__(self, lm: LoadedModel, log: Callable[[str], None] = lambda line: None):
        self.lm, self.log = lm, log
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.arrivals = itertools.count(1)
        self.starts = itertools.count(1)
        self.waiting = 0  # jobs submitted and not yet ended
        self.lock = threading.Lock()
        self.current: Job | None = None
        self.stopped = False
        self.history: collections.deque[Job] = collections.deque(maxlen=HISTORY)  # the last jobs ended, in order
        self.prompt_cache = PromptCache()  # the last reply's states: a conversation's next request prefills only its new turn
        self.thread = threading.Thread(target=self._serve, name="duet-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> int:
        """Queue a job; returns how many jobs are ahead of it."""
        job.loop, job.events = asyncio.get_running_loop(), asyncio.Queue()
        with self.lock:
            if self.stopped:
                raise Stopping("the server is stopping: the request was not run")
            job.received, ahead = next(self.arrivals), self.waiting
            self.waiting += 1
            job.submitted_at = time.perf_counter()
            self.jobs.put(job)
        return ahead

    def stop(self) -> None:
        """Cancel the running and the waiting jobs and end the thread after them (Ctrl-C)."""
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
            pending = list(self.jobs.queue) + [self.current]
        for job in pending:
            if job is not None:
                job.cancel.set()
        self.jobs.put(None)

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            job.started, job.waited_s = next(self.starts), time.perf_counter() - job.submitted_at
            self.current = job
            try:
                if job.cancel.is_set():
                    job.finish = "cancelled"
                else:
                    self._run(job)
            except DuetError as error:
                job.finish = "error"
                job.put(error)
            except Exception as error:  # an engine bug: the request gets a 500, the server goes on
                job.finish = "error"
                job.put(error)
                self.log(f"request {job.received}: engine error {type(error).__name__}: {error}")
            finally:
                self.current = None
                with self.lock:
                    self.waiting -= 1
                    self.history.append(job)
                job.put(None)

    def _run(self, job: Job) -> None:
        scan = StopScan(job.stop)
        for event in generate(self.lm, job.prompt_ids, job.options, cancel=job.cancel, switches=job.switches,
                              cache=self.prompt_cache, turn_start=job.turn_start):
            if isinstance(event, Tokens):
                job.generated_tokens = event.stats.generated_tokens
                if job.finish == "stop":  # past a stop string: the cycle in flight ends the reply
                    continue
                text, stopped = scan.feed(event.text)
                if text:
                    job.put(dataclasses.replace(event, text=text))
                if stopped:
                    job.finish = "stop"
                    job.cancel.set()  # the engine ends the reply at this cycle and reports "cancelled"
            elif isinstance(event, Finished):
                if not job.finish:
                    job.finish = event.finish_reason
                    tail = scan.flush()
                    if tail:
                        job.put(Tokens([], tail, event.stats))
                job.put(dataclasses.replace(event, finish_reason=job.finish))
                stats = event.stats
                self.log(f"request {job.received}: {stats.generated_tokens} tokens at {stats.decode_tok_s:.1f} tok/s, "
                         f"{stats.tokens_per_cycle:.2f} tokens/cycle, {job.finish}")


class StopScan:
    """Stop strings over streamed text: text is let through once it cannot be the start of a stop
    string, and ends just before the first stop string found."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.held = stops, ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send now, whether a stop string was found)."""
        if not self.stops:
            return text, False
        self.held += text
        found = [i for i in (self.held.find(stop) for stop in self.stops) if i >= 0]
        if found:
            out, self.held = self.held[:min(found)], ""
            return out, True
        keep = max((n for stop in self.stops for n in range(1, len(stop)) if self.held.endswith(stop[:n])), default=0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


# ------------------------------------------------------------------------ request fields ---

def _number(body: dict, name: str, default: float, *, whole: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
        raise RequestError(f"{name} must be {'a whole number' if whole else 'a number'} (got {json.dumps(value)})", name)
    return value


def _text_content(content, where: str) -> str:
    """A message's content: a string, or OpenAI's list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"{where}.content must be a string or a list of text parts (this model reads text only)",
                       "messages")


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with role and content", "messages")
        role = "system" if message.get("role") == "developer" else message.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)} (got {json.dumps(message.get('role'))})",
                               "messages")
        out.append({"role": role, "content": _text_content(message.get("content"), where)})
    return out


def completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("prompt must be a non-empty string (one prompt a request)", "prompt")
    return prompt


def stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    return tuple(stops)


@dataclass(frozen=True)
class ServeSettings:
    """What requests start from: the chat app's reply settings, this run's engine flags and budget."""

    config: Config
    choices: EngineChoices
    accept: Accept
    route: Route  # the loaded model's: a request that asked for another does not change the next one's
    budget: int


def request_options(body: dict, settings: ServeSettings, lm: LoadedModel) -> tuple[GenerateOptions, Switches]:
    """The engine options of a request: its fields over the server's settings, each checked, and
    duet's own (`duet`: accept, draft, depth, route) over the server's engine flags."""
    if body.get("n", 1) != 1:
        raise RequestError("n must be 1: duet runs one reply a request", "n")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise RequestError("logprobs are not available from duet", "logprobs")
    if _number(body, "frequency_penalty", 0.0) != 0:
        raise RequestError("frequency_penalty is not available from duet; presence_penalty and repetition_penalty are",
                           "frequency_penalty")
    c = settings.config
    max_tokens = _number(body, "max_completion_tokens", _number(body, "max_tokens", c.max_tokens, whole=True), whole=True)
    try:
        config = dataclasses.replace(
            c, max_tokens=max_tokens, temperature=_number(body, "temperature", c.temperature),
            top_k=_number(body, "top_k", c.top_k, whole=True), top_p=_number(body, "top_p", c.top_p),
            min_p=_number(body, "min_p", c.min_p), presence_penalty=_number(body, "presence_penalty", c.presence_penalty),
            repetition_penalty=_number(body, "repetition_penalty", c.repetition_penalty),
            seed=_number(body, "seed", c.seed, whole=True))
        extension = body.get("duet") or {}
        if not isinstance(extension, dict):
            raise RequestError("duet must be an object: {accept, draft, depth, route}", "duet")
        choices, accept, route = _duet_fields(extension, settings, lm)
        options = reply_options(config, settings.budget, choices, accept)
    except RequestError:
        raise
    except DuetError as error:
        raise RequestError(str(error)) from None
    return options, Switches(accept, route)


def _duet_fields(extension: dict, settings: ServeSettings, lm: LoadedModel) -> tuple[EngineChoices, Accept, Route]:
    def word(name: str, words, allowed=None):
        value = extension.get(name)
        if value is None:
            return None
        allowed = tuple(allowed if allowed is not None else words)
        if value not in allowed:
            raise RequestError(f"duet.{name} must be one of {', '.join(allowed)} (got {json.dumps(value)})", f"duet.{name}")
        return type(allowed[0])(value)

    accept = word("accept", Accept) or settings.accept
    draft = word("draft", Draft, [d for d in Draft if d != Draft.MTP or lm.model.mtp is not None]) or settings.choices.draft
    route = word("route", Route, [Route(r) for r in lm.routes]) or settings.route
    depth = extension.get("depth", settings.choices.depth)
    if depth == "auto":
        depth = None
    cap = depth_cap(draft, lm.model)
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or cap and not 1 <= depth <= cap):
        raise RequestError(f"duet.depth must be auto or 1 to {cap} for {draft} drafts (got {json.dumps(depth)})",
                           "duet.depth")
    return dataclasses.replace(settings.choices, draft=draft, depth=depth), accept, route


# -------------------------------------------------------------------------- the server ---

def build_app(engine: EngineQueue, settings: ServeSettings, api_key: str | None = None):
    """The Starlette application: routes, auth, errors in OpenAI's shape."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route as Path

    lm = engine.lm
    created = int(time.time())

    def error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)

    def refused(request: Request) -> JSONResponse | None:
        if api_key is None:
            return None
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode()):
            return None
        return error(401, "a valid API key is needed: send Authorization: Bearer KEY", "authentication_error")

    async def models(request: Request) -> JSONResponse:
        if (denied := refused(request)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [
            {"id": lm.name, "object": "model", "created": created, "owned_by": "duet",
             "duet": {"routes": list(lm.routes), "route": lm.route, "mtp": lm.model.mtp is not None,
                      "context": settings.budget}}]})

    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    async def completions(request: Request):
        return await complete(request, chat=False)

    async def complete(request: Request, chat: bool):
        if (denied := refused(request)) is not None:
            return denied
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as failure:
            return error(400, f"the request body is not JSON: {failure}", "invalid_request_error")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object", "invalid_request_error")
        try:
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise RequestError("stream must be true or false", "stream")
            options, switches = request_options(body, settings, lm)
            stops = stop_strings(body)
            text = lm.tokenizer.render_chat(chat_messages(body)) if chat else completion_prompt(body)
            prompt_ids = lm.tokenizer.encode(text)
            if len(prompt_ids) >= settings.budget:
                raise RequestError(f"the prompt is {len(prompt_ids):,} tokens but the context budget is "
                                   f"{settings.budget:,}; shorten it (or start duet serve with a larger --context)",
                                   "messages" if chat else "prompt")
            turn_start = lm.tokenizer.turn_start(chat_messages(body), prompt_ids) if chat else None
        except RequestError as failure:
            return error(400, str(failure), "invalid_request_error", failure.param)
        except DuetError as failure:  # the chat template refused the messages
            return error(400, str(failure), "invalid_request_error", "messages")
        job = Job(prompt_ids, options, switches, stops, turn_start=turn_start)
        try:
            ahead = engine.submit(job)
        except Stopping as failure:
            return error(503, str(failure), "server_error")
        reply = Reply(job, lm.name, chat)
        headers = {"x-duet-queued-ahead": str(ahead)}
        if stream:  # a client that leaves shows when a chunk cannot be sent (Reply.chunks)
            include_usage = isinstance(body.get("stream_options"), dict) and body["stream_options"].get("include_usage")
            return StreamingResponse(reply.chunks(bool(include_usage)), media_type="text/event-stream", headers=headers)
        watcher = asyncio.create_task(_cancel_when_gone(request, job))
        try:
            return JSONResponse(await reply.whole(), headers=headers)
        except Stopping as failure:
            return error(503, str(failure), "server_error")
        except DuetError as failure:
            return error(400, str(failure), "invalid_request_error")
        except Exception as failure:
            return error(500, f"the engine failed: {type(failure).__name__}: {failure}", "server_error")
        finally:
            watcher.cancel()

    return Starlette(routes=[
        Path("/v1/models", models, methods=["GET"]),
        Path("/v1/chat/completions", chat_completions, methods=["POST"]),
        Path("/v1/completions", completions, methods=["POST"]),
    ])


async def _cancel_when_gone(request, job: Job) -> None:
    """Cancel a non-streaming request's reply if its client disconnects while it runs or waits."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    job.cancel.set()


class Reply:
    """A job's events as OpenAI's response objects: whole, or as server-sent event chunks."""

    def __init__(self, job: Job, model: str, chat: bool):
        self.job, self.model, self.chat = job, model, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    async def events(self) -> AsyncIterator[Tokens | Finished]:
        """The engine's events until the job ends; an error the engine raised is raised here."""
        while (item := await self.job.events.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item

    async def whole(self) -> dict:
        pieces, finished = [], None
        try:
            async for event in self.events():
                if isinstance(event, Tokens):
                    pieces.append(event.text)
                else:
                    finished = event
        finally:
            self.job.cancel.set()  # a client gone before the end: stop the reply (nothing left to do if it ended)
        if finished is None:
            raise Stopping("the server is stopping: the request was not run")
        text = "".join(pieces)
        choice = {"index": 0, "finish_reason": OPENAI_FINISH.get(finished.finish_reason)}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text, "logprobs": None})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
                "model": self.model, "choices": [choice], "usage": usage(finished.stats), "duet": self.summary(finished)}

    async def chunks(self, include_usage: bool) -> AsyncIterator[str]:
        try:
            if self.chat:
                yield _sse(self.chunk({"role": "assistant", "content": ""}))
            async for event in self.events():
                if isinstance(event, Tokens):
                    if event.text:
                        yield _sse(self.chunk({"content": event.text} if self.chat else event.text))
                else:
                    last = self.chunk({} if self.chat else "", OPENAI_FINISH.get(event.finish_reason))
                    last.update({"usage": usage(event.stats)} if include_usage else {})
                    last["duet"] = self.summary(event)
                    yield _sse(last)
        except Exception as failure:  # the status went with the first chunk: the error goes in the stream
            kind = "invalid_request_error" if isinstance(failure, DuetError) else "server_error"
            yield _sse({"error": {"message": str(failure), "type": kind, "param": None, "code": None}})
        finally:
            self.job.cancel.set()  # the client left mid-stream (or the reply ended): the engine stops at the next cycle
        yield "data: [DONE]\n\n"

    def chunk(self, delta: dict | str, finish: str | None = None) -> dict:
        """One stream chunk: a chat delta, or a completion's text."""
        choice = {"index": 0, "finish_reason": finish}
        choice.update({"delta": delta} if self.chat else {"text": delta, "logprobs": None})
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def summary(self, finished: Finished) -> dict:
        """duet's own figures for the reply: what the engine did and how fast, and where it queued."""
        job = self.job
        return {"finish_reason": finished.finish_reason, "drafter": finished.drafter, "stats": finished.stats.to_dict(),
                "queue": {"received": job.received, "started": job.started, "waited_s": round(job.waited_s, 4)}}


def usage(stats: Stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


# ------------------------------------------------------------------------ the command ---

def add_serve_command(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1, this machine only; another only when asked)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--api-key", help=f"ask every request for this bearer token (or set {API_KEY_VARIABLE})")
    parser.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from duet.app.headless import ProgressBar

    paths = user_paths()
    config = load_config(paths.config_file)
    choices = engine_choices(args)
    api_key = args.api_key or os.environ.get(API_KEY_VARIABLE) or None
    if not 0 <= args.port <= 65535:
        raise DuetError(f"--port must be from 0 to 65535 (got {args.port})")
    with bind(args.host, args.port) as listener:  # first: a taken port is said before a long load
        bar = ProgressBar(sys.stderr) if sys.stderr.isatty() else None
        lm = load_model(chat_model_path(args.model, config, paths), progress=bar, route=args.route,
                        host_tables=choices.host_tables)
        if bar:
            bar.close()
        budget = args.context or lm.config.max_position_embeddings
        if not 2 <= budget <= lm.config.max_position_embeddings:
            raise DuetError(f"--context must be from 2 to {lm.config.max_position_embeddings:,} tokens (got {budget:,})")
        log = lambda line: print(f"duet serve: {line}", file=sys.stderr, flush=True)  # noqa: E731
        engine = EngineQueue(lm, log)
        app = build_app(engine, ServeSettings(config, choices, args.accept, Route(lm.route), budget), api_key)
        host, port = listener.getsockname()[:2]
        log(f"{lm.name} on the {lm.route} route at http://{_url_host(host)}:{port}/v1 "
            f"(one request at a time; {'a key is required' if api_key else 'no key'}); Ctrl-C stops")
        if args.host not in LOOPBACK and not api_key:
            log(f"listening beyond this machine without a key: anyone who reaches {args.host} can use the model "
                f"(set --api-key or {API_KEY_VARIABLE})")
        serve(app, engine, listener)
    return 0


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, made here so a taken port or a bad address is one line, not uvicorn's log."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as failure:
        raise DuetError(f"cannot listen on {host}:{port}: {failure.strerror or failure}; "
                        "choose another --port or --host") from None


def serve(app, engine: EngineQueue, listener: socket.socket) -> None:
    """Run the server on `listener` until Ctrl-C."""
    make_server(app, engine).run(sockets=[listener])
    engine.stop()


def make_server(app, engine: EngineQueue, log_level: str = "warning"):
    """uvicorn's server for `app`. Ctrl-C (or `handle_exit`) cancels the engine's jobs first, so a reply
    streaming then ends at its next cycle and the server stops without waiting it out."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine.stop()
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
