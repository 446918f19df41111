"""The engine loop in a process of its own, the HTTP server's front end in another (``hypertron
serve --engine-process``).

In one process the event loop (HTTP, JSON, tokenizing, detokenizing, streaming) and the engine
loop's thread share the GIL: each waits for the other's Python, and a burst of requests being
parsed holds back the next step. vLLM runs its API server and its engine core as two processes
for this reason; so does this module:

- the *engine process* (:func:`_engine_main`, a new interpreter) builds the engine and its
  :class:`~hypertron.serve.orchestrator.Orchestrator` from a factory (``hypertron serve``'s:
  :func:`hypertron.serve.readying.engine_side`), reads the front end's messages on its main thread
  and hands them to the orchestrator, whose loop thread sends back each step's outputs in one
  message (:class:`_EngineCore`);
- the *front end* (:class:`EngineClient`, in the server's process) offers what the server uses of
  an orchestrator (``submit`` returning a :class:`~hypertron.serve.output.Generation`,
  ``reset_prefix_cache``, ``exposition``, ``running``, ``start`` / ``stop``); the server's event
  loop reads the engine's socket when it is readable (no thread of its own: the front end's Python runs on one
  thread) and hands the outputs to the requests' queues, where detokenizing and stop strings happen
  as before.

The two talk over two socket pairs (one each way), one pickled tuple a message:

- front end to engine: ``("submit", id, prompt, sampling, want_prompt_logprobs, cache_salt,
  grammar, adapter)``, ``("cancel", id)``, ``("reset", call)``, ``("metrics", call)``,
  ``("lora_load", call, name, path)``, ``("lora_unload", call, name)``, ``("stop",)``;
- engine to front end: ``("ready", info)`` or ``("failed", error)`` once, then ``("out", [(id,
  token, logprobs, prompt_logprobs, finish_reason, error, cached_tokens), ...], waiting, taken)``
  per step, ``("reply", call, value, error)``, ``("stopped",)`` last.

The front end bounds the queue (``max_queue``) itself: the engine reports with each step how many
requests wait and how many it has taken, and a request sent since counts as waiting (an upper
bound: it refuses early rather than late). Requests are checked in the front end as in one process
(prompt, token ids, sampling) before they are sent. A grammar (structured output) is compiled in
both: the front end's checks it (a 400), the engine's keeps the request to it. Metrics: each side
exports its own (:data:`~hypertron.serve.metrics.REQUEST_SIDE`: the front end's), ``GET /metrics``
both. If the engine process ends (a crash, a kill), every open request ends with ``abort`` and the
server's ``/health`` answers 503. The engine process ignores SIGINT (the front end stops it) and
ends when the front end's socket closes. LoRA adapters live in the engine process's
slots; the front end knows which are loaded from its replies to loads and unloads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from prometheus_client import CollectorRegistry, generate_latest

from hypertron.errors import UserError
from hypertron.serve.metrics import REQUEST_SIDE, ServeMetrics
from hypertron.serve.orchestrator import ABORT, LoopTarget, Orchestrator, QueueFull, Submission
from hypertron.serve.output import Generation
from hypertron.serve.scheduler import Output, Request, check_prompt
from hypertron.serve.types import LoraError, SamplingParams, check_token_ids

log = logging.getLogger(__name__)

ENDED = "the engine process ended"  # what the open requests are told when it does (503)
STOPPED = "the server stopped"
STOP_WAIT_S = 10.0  # stop: how long the engine process gets to abort its requests and end
CALL_WAIT_S = 10.0  # a call (metrics) waits this long for the engine's reply
_CHILD = "from hypertron.serve.engine_process import _engine_main; _engine_main()"


class _Channel:
    """Pickled messages, each after its length, over two one-way sockets: ``out`` to write (blocking,
    from any thread) and ``inp`` to read, whole messages at a time (:meth:`recv`), or, once
    :meth:`nonblocking`, what has arrived (:meth:`received`, for an event loop's reader callback;
    uvloop puts a polled descriptor in non-blocking mode anyway)."""

    HEADER = struct.Struct("!Q")

    def __init__(self, out: socket.socket, inp: socket.socket):
        self.out, self.inp = out, inp
        self.lock = threading.Lock()
        self.buf = bytearray()

    def send(self, msg) -> None:
        """OSError once the other side is gone."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self.lock:
            self.out.sendall(self.HEADER.pack(len(data)) + data)

    def recv(self):
        """The next message, waiting for it; EOFError once the other side is gone."""
        (n,) = self.HEADER.unpack(self._exactly(self.HEADER.size))
        return pickle.loads(self._exactly(n))

    def _exactly(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = self.inp.recv(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return bytes(data)

    def nonblocking(self) -> None:
        self.inp.setblocking(False)

    def received(self) -> tuple[list, bool]:
        """``(messages, ended)``: the whole messages that have arrived, and whether the other side is gone."""
        ended = False
        try:
            while chunk := self.inp.recv(1 << 20):
                self.buf += chunk
            ended = True  # b"": the other side closed
        except BlockingIOError:
            pass
        except OSError:
            ended = True
        messages, size = [], self.HEADER.size
        while len(self.buf) >= size:
            (n,) = self.HEADER.unpack_from(self.buf)
            if len(self.buf) < size + n:
                break
            messages.append(pickle.loads(self.buf[size:size + n]))
            del self.buf[:size + n]
        return messages, ended

    def close(self) -> None:
        self.out.close()
        self.inp.close()


# -- the engine process --------------------------------------------------------------------


def _engine_main() -> None:
    """The engine process (``python -c``; argv[1] the socket it reads, argv[2] the one it writes):
    it reads the front end's ``sys.path`` and then ``(factory, args)``; ``factory(*args)`` is ``(orchestrator,
    model_name)`` (not started)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C reaches the whole process group: the front end stops it
    conn = _Channel(socket.socket(fileno=int(sys.argv[2])), socket.socket(fileno=int(sys.argv[1])))
    sys.path[:] = conn.recv()
    try:
        factory, args = pickle.loads(conn.recv())
        orch, model_name = factory(*args)
    except BaseException as e:  # noqa: BLE001 - the front end reports it; a user's mistake in one line
        if not isinstance(e, UserError):
            log.exception("the engine process failed to start")
        try:
            conn.send(("failed", e if isinstance(e, UserError) else RuntimeError(f"{type(e).__name__}: {e}")))
        finally:
            end_process(1)
    orch.max_queue = sys.maxsize  # the front end bounds the queue: it knows what it has sent
    try:
        conn.send(("ready", {"tokenizer": orch.tokenizer, "model_name": model_name, "max_seq_len": orch.max_seq_len,
                             "max_top_logprobs": orch.max_top_logprobs, "vocab_size": orch.vocab_size,
                             "kv_pool_tokens": orch.kv_pool_tokens,
                             "adapters": None if orch.lora is None else orch.lora.adapters()}))
    except OSError:  # the front end went away while the engine was loading
        end_process(1)
    _EngineCore(orch, conn).serve()
    end_process(0)


def end_process(code: int) -> NoReturn:
    """End this serving process (the engine's, or ``hypertron serve``'s once uvicorn returns) without
    the interpreter's finalization, logs flushed: JAX's native threads (its compiler's, XLA's pools)
    outliving it can abort the process as it ends ("terminate called ...", "pure virtual method
    called", status 134, seen after a clean stop)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _EngineCore:
    """The engine process's side: the front end's messages to ``orch``, its outputs back (this
    object is their :class:`~hypertron.serve.orchestrator.Orchestrator.add` target)."""

    def __init__(self, orch: Orchestrator, conn):
        self.orch, self.conn = orch, conn
        self.lock = threading.Lock()
        self.requests: dict[int, Submission] = {}  # the front end's id -> the request (until it ends)
        self.taken = 0
        self.grammars = None

    def serve(self) -> None:
        self.orch.start()
        try:
            while True:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):  # the front end is gone
                    break
                if msg[0] == "stop":
                    break
                getattr(self, "_on_" + msg[0])(*msg[1:])
        finally:
            self.orch.stop()  # what is left ends with abort, sent by deliver
            self._send(("stopped",))
            self.conn.close()

    def _send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except OSError:  # the front end is gone (or this end closed): nothing to tell
            pass

    def deliver(self, pairs: list[tuple[int, Output]]) -> None:
        """A step's outputs (the loop thread), in one message with the queue's length."""
        wire = []
        with self.lock:
            for fid, out in pairs:
                if out.finish_reason is not None:
                    self.requests.pop(fid, None)
                wire.append((fid, out.token, out.logprobs, out.prompt_logprobs, out.finish_reason, out.error,
                             out.seq.cached_tokens))
            taken = self.taken
        self._send(("out", wire, self.orch.waiting, taken))

    def _on_submit(self, fid: int, prompt, sampling, want_prompt_logprobs, cache_salt, grammar, adapter) -> None:
        error = None
        try:  # checked in the front end: only a race or a bug fails here
            guide = None if grammar is None else self._grammars().guide(grammar)  # before the lock deliver takes
            with self.lock:
                self.requests[fid] = self.orch.add(prompt, sampling, self, fid, cache_salt=cache_salt, guide=guide,
                                                   want_prompt_logprobs=want_prompt_logprobs, adapter=adapter)
        except Exception as e:  # noqa: BLE001 - the request ends, the engine goes on
            log.warning("request %d refused by the engine process: %s", fid, e)
            error = f"the engine refused the request: {e}"
        with self.lock:
            self.taken += 1
            taken = self.taken
        if error is not None:
            self._send(("out", [(fid, None, None, None, ABORT, error, None)], self.orch.waiting, taken))

    def _grammars(self):
        from hypertron.serve.structured import Grammars  # llguidance: only for a guided request

        if self.grammars is None:
            self.grammars = Grammars(self.orch.tokenizer, self.orch.vocab_size)
        return self.grammars

    def _on_cancel(self, fid: int) -> None:
        with self.lock:  # the orchestrator ends it without an output: forgotten here
            req = self.requests.pop(fid, None)
        if req is not None:
            self.orch.cancel(req)

    def _on_reset(self, call: int) -> None:
        try:
            future = self.orch.reset_prefix_cache()
        except RuntimeError as e:
            self._send(("reply", call, None, str(e)))
            return
        future.add_done_callback(lambda f: self._send(("reply", call, f.result(), None) if f.exception() is None
                                                      else ("reply", call, None, str(f.exception()))))

    def _on_lora_load(self, call: int, name: str, path: str) -> None:
        # It reads the adapter's files and writes its slot: on a thread of its own, not holding up intake.
        threading.Thread(target=self._lora, args=(call, lambda: self.orch.lora.load(name, path)), daemon=True,
                         name="hypertron-lora-load").start()

    def _on_lora_unload(self, call: int, name: str) -> None:
        self._lora(call, lambda: self.orch.lora.unload(name))

    def _lora(self, call: int, change) -> None:
        """Reply with ``change()``'s value and the adapters loaded after it, or its LoraError."""
        try:
            value = change()
        except LoraError as e:
            self._send(("reply", call, None, e))
            return
        except Exception as e:  # noqa: BLE001 - a bug: its traceback here, a 500 there
            log.exception("a LoRA adapter's load or unload failed")
            self._send(("reply", call, None, f"{type(e).__name__}: {e}"))
            return
        self._send(("reply", call, (value, self.orch.lora.adapters()), None))

    def _on_metrics(self, call: int) -> None:
        self.orch.count_compiles()
        self._send(("reply", call, [f for f in self.orch.metrics.registry.collect() if f.name not in REQUEST_SIDE],
                    None))


# -- the front end ------------------------------------------------------------------------


class _Families:
    """Metric families collected elsewhere, as a registry for ``generate_latest``."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


class _Adapters:
    """The engine process's LoRA slots as the server sees them (:class:`~hypertron.serve.lora_slots.LoraSlots`'
    ``adapters``, ``load``, ``unload``): what it has loaded, known from its replies (nothing else
    changes them). ``load`` and ``unload`` wait for the engine: call them off the reading event loop."""

    def __init__(self, client: EngineClient, adapters):
        self._client, self._adapters = client, list(adapters)

    def adapters(self) -> list:
        return list(self._adapters)

    def load(self, name: str, path: str):
        adapter, self._adapters = self._client._call("lora_load", name, path).result()
        return adapter

    def unload(self, name: str) -> None:
        _, self._adapters = self._client._call("lora_unload", name).result()


class EngineClient:
    """The front end of an engine in a process of its own (see the module docstring).

    Starts the engine process with ``factory(*args)`` and waits until it is ready (the model
    loaded, its first shapes compiled): a :class:`~hypertron.errors.UserError` the factory raised
    is raised here; any other failure as a RuntimeError. ``max_queue``: as
    :class:`~hypertron.config.SchedulerConfig`'s. Then :attr:`tokenizer`, :attr:`model_name` and
    the engine's limits are the engine's.
    """

    def __init__(self, factory, args: Sequence = (), *, max_queue: int, registry: CollectorRegistry | None = None):
        # A new interpreter (JAX's runtime does not survive a fork), not multiprocessing's spawn,
        # which runs the __main__ module again: a script without a __main__ guard would start over.
        (to_engine, engine_reads), (engine_writes, from_engine) = socket.socketpair(), socket.socketpair()
        fds = [engine_reads.fileno(), engine_writes.fileno()]
        self._process = subprocess.Popen([sys.executable, "-c", _CHILD, *map(str, fds)], pass_fds=fds)
        engine_reads.close()
        engine_writes.close()
        self._conn = _Channel(to_engine, from_engine)
        try:
            self._conn.send(list(sys.path))
            self._conn.send(pickle.dumps((factory, tuple(args))))  # unpickled there once sys.path is set
            kind, info = self._conn.recv()
        except (EOFError, OSError):
            self._wait(STOP_WAIT_S)
            raise RuntimeError(f"the engine process ended while starting (exit code {self._process.returncode})") \
                from None
        if kind == "failed":
            self._wait(STOP_WAIT_S)
            raise info
        self.tokenizer, self.model_name = info["tokenizer"], info["model_name"]
        self.max_seq_len, self.max_top_logprobs = info["max_seq_len"], info["max_top_logprobs"]
        self.vocab_size, self.kv_pool_tokens = info["vocab_size"], info["kv_pool_tokens"]
        self.lora = None if info["adapters"] is None else _Adapters(self, info["adapters"])
        self.max_queue = max_queue
        self.metrics = ServeMetrics(registry)
        self._lock = threading.Lock()
        self._ids, self._calls_ids = itertools.count(), itertools.count()
        self._open: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Request]] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._sent = self._taken = self._waiting = 0
        self._stopping = self._ended = False
        self._reading: asyncio.AbstractEventLoop | None = None  # the event loop that reads the engine's socket
        self._done = threading.Event()  # set once the engine process has stopped or gone (_end)

    # -- what the server uses ------------------------------------------------------------

    @property
    def running(self) -> bool:
        return not (self._stopping or self._ended) and self._process.poll() is None

    def start(self) -> EngineClient:
        """Read the engine's messages on the running event loop (the server's; else the first
        that submits a request). The engine itself runs from the start."""
        try:
            self._read_on(asyncio.get_running_loop())
        except RuntimeError:  # no running loop: the first submit's
            pass
        return self

    def submit(self, prompt: Sequence[int], sampling: SamplingParams, *, stop: Sequence[str] = (),
               want_prompt_logprobs: bool = False, cache_salt: str | None = None, adapter: str | None = None,
               guide=None) -> Generation:
        """As :meth:`Orchestrator.submit <hypertron.serve.orchestrator.Orchestrator.submit>` (the
        same checks and errors), but for an ``adapter`` unloaded since the request was read: the
        engine process ends that request with ``abort``."""
        prompt = list(map(int, prompt))
        check_prompt(prompt, self.max_seq_len)
        check_token_ids(prompt, self.vocab_size, "prompt")
        sampling.check(vocab_size=self.vocab_size, max_top_logprobs=self.max_top_logprobs)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        self._read_on(loop)
        with self._lock:
            if not self.running:
                raise RuntimeError("the engine is not running" + (f" ({ENDED})" if self._ended else ""))
            waiting = self._waiting + self._sent - self._taken
            if waiting >= self.max_queue:
                raise QueueFull(f"{waiting} requests are waiting already (max_queue)")
            fid = next(self._ids)
            seq = Request(fid, prompt, sampling, want_prompt_logprobs, cache_salt)
            self._open[fid] = (loop, queue, seq)
            self._sent += 1
        self._send(("submit", fid, prompt, sampling, want_prompt_logprobs, cache_salt,
                    None if guide is None else guide.grammar, adapter))
        return Generation(seq, queue, self.tokenizer, self.metrics, lambda: self._cancel(fid), stop)

    def reset_prefix_cache(self) -> concurrent.futures.Future:
        """A future of how many cached pages the engine dropped. RuntimeError when not running."""
        if not self.running:
            raise RuntimeError("the engine is not running")
        return self._call("reset")

    def exposition(self) -> bytes:
        """``GET /metrics``: this side's request metrics and the engine process's own (only the
        former once it has ended)."""
        mine = [f for f in self.metrics.registry.collect() if f.name in REQUEST_SIDE]
        theirs = []
        if self.running:
            try:
                theirs = self._call("metrics").result(CALL_WAIT_S)
            except (RuntimeError, concurrent.futures.TimeoutError) as e:
                log.warning("the engine process's metrics: %s", e)
        return generate_latest(_Families(mine + theirs))

    def stop(self, timeout: float = STOP_WAIT_S) -> None:
        """Stop the engine process (what is left ends with ``abort``) and wait for it; one that
        does not end in ``timeout`` seconds is killed. Call it off the reading event loop (it
        waits for that loop to read the engine's last messages): ``asyncio.to_thread``."""
        self._stopping = True
        self._send(("stop",))
        if self._reading is not None and not self._reading.is_closed():
            self._done.wait(timeout)
        if not self._wait(timeout):
            log.warning("the engine process did not stop in %.0f s: killing it", timeout)
            self._process.kill()
            self._wait(timeout)
        if not self._done.is_set():  # nobody read its last messages: its requests end here
            self._unread()
            self._end()
        self._conn.close()

    def _wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the engine process to end; whether it has."""
        try:
            self._process.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    # -- the sockets ---------------------------------------------------------------------

    def _send(self, msg) -> None:
        try:
            self._conn.send(msg)
        except OSError:  # the engine process has ended: the reader ends the requests
            pass

    def _call(self, kind: str, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._ended:
                future.set_exception(RuntimeError(ENDED))
                return future
            call = next(self._calls_ids)
            self._calls[call] = future
        self._send((kind, call, *args))
        return future

    def _cancel(self, fid: int) -> None:
        """End request ``fid`` (its consumer went away or stopped): forgotten here, ended there
        (without an output, as in one process); a no-op once it has ended."""
        with self._lock:
            open_ = self._open.pop(fid, None) is not None
        if open_:
            self._send(("cancel", fid))

    def _read_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the engine's socket on ``loop`` (a callback when it is readable: no thread of its own, so no
        GIL to share with the event loop), unless a live loop reads it already."""
        with self._lock:
            if self._ended or (self._reading is not None and not self._reading.is_closed()):
                return
            self._reading = loop
        self._conn.nonblocking()
        loop.add_reader(self._conn.inp.fileno(), self._on_readable)

    def _unread(self) -> None:
        loop, fd = self._reading, self._conn.inp.fileno()
        if loop is None or loop.is_closed():
            return
        try:
            if loop is _running_loop():
                loop.remove_reader(fd)
            else:
                loop.call_soon_threadsafe(loop.remove_reader, fd)
        except RuntimeError:  # closed meanwhile
            pass

    def _on_readable(self) -> None:
        """The engine's messages that have arrived: outputs to their queues, replies to their futures."""
        messages, ended = self._conn.received()
        for msg in messages:
            if msg[0] == "out":
                self._on_outputs(*msg[1:])
            elif msg[0] == "reply":
                _, call, value, error = msg
                with self._lock:
                    future = self._calls.pop(call, None)
                if future is None:
                    continue
                if error is None:
                    future.set_result(value)
                else:
                    future.set_exception(error if isinstance(error, Exception) else RuntimeError(error))
            elif msg[0] == "stopped":
                ended = True
        if ended:
            self._unread()
            self._end()

    def _on_outputs(self, wire, waiting: int, taken: int) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Output]]] = {}
        with self._lock:
            self._waiting, self._taken = waiting, taken
            for fid, token, logprobs, prompt_logprobs, finish_reason, error, cached in wire:
                entry = self._open.get(fid)
                if entry is None:
                    continue
                loop, queue, seq = entry
                if cached is not None:
                    seq.cached_tokens = cached
                if finish_reason is not None:
                    del self._open[fid]
                by_loop.setdefault(loop, []).append((queue, Output(seq, token, logprobs, prompt_logprobs,
                                                                   finish_reason, error)))
        self._hand(by_loop)

    def _hand(self, by_loop) -> None:
        for loop, pairs in by_loop.items():
            if loop is _running_loop():
                for queue, out in pairs:
                    queue.put_nowait(out)
                continue
            try:
                LoopTarget(loop).deliver(pairs)
            except RuntimeError:  # that event loop is closed: nobody consumes its requests
                for _, out in pairs:
                    self._cancel(out.seq.id)

    def _end(self) -> None:
        """The engine process has stopped or gone: every open request and call ends."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            why = STOPPED if self._stopping else ENDED
            open_, self._open = self._open, {}
            calls, self._calls = self._calls, {}
        if not self._stopping:
            log.error("%s (exit code %s): its requests end", ENDED, self._process.poll())
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Output]]] = {}
        for loop, queue, seq in open_.values():
            by_loop.setdefault(loop, []).append((queue, Output(seq, finish_reason=ABORT, error=why)))
        self._hand(by_loop)
        for future in calls.values():
            future.set_exception(RuntimeError(why))
        self._done.set()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
