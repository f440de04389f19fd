"""Large request bodies decoded in a child process, so that the server's own lock is never held for long.

`json.loads` is one C call that holds Python's lock (the GIL) from the first byte to the last, on whatever
thread runs it: 60 ms for a 10 MB prompt sent as 30 MB of `\\ud83d\\ude00` escapes, about 2 s for 30 MB of
short values, and `/health` waits that long. The worker decodes and checks a body (`parse_json_body`: the
same object or the same typed 400; then the route's counts of top-level arrays, `limits.check_array_counts`,
so that 20,000 tools are refused there and never handed over), and sends the object back pickled, each long
string in slices. The server unpickles it on a thread from a reader whose `read` is Python code, so the lock can
change hands between two 64 KiB frames or two slices: no step of taking the body back holds it for more than a
millisecond or so.

The worker is started on the first large body, runs `python -P` on this file (it imports `swarmkv.api.errors`
and `limits` alone, not the server), takes one body at a time over its stdin and answers on its stdout. A worker
that dies is started again for the next body, and the body it had is decoded in the server, as before.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Collection
from pathlib import Path
from typing import IO, Any

from swarmkv.api.errors import APIError, parse_json_body
from swarmkv.api.limits import check_array_counts

log = logging.getLogger(__name__)

# A string longer than this goes back in slices of it: a slice of emoji is 256 KiB of UTF-8, under a
# millisecond to decode.
SLICE_CHARS = 1 << 16
_FRAME = struct.Struct("<BQ")  # a reply's kind and its payload's length
_BODY_FRAME = struct.Struct("<QH")  # a body's length and its counted arrays' names' (comma-joined, ASCII)
_BODY, _REFUSED, _FAILED = 0, 1, 2


class JsonWorker:
    """The server's side: `decode(raw)` is `parse_json_body(raw)`, computed in the worker process. Blocking:
    call it from a worker thread. Safe from any thread; one body at a time goes to the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one body at a time in the pipe
        self._process: subprocess.Popen[bytes] | None = None
        self._closed = False

    def decode(self, raw: bytes, counted: Collection[str] = ()) -> dict[str, Any]:
        """The body as a JSON object, or `parse_json_body`'s 400, or `check_array_counts`' 400 for its
        top-level arrays `counted`."""
        with self._lock:
            try:
                kind, payload = self._ask(raw, counted)
            except (OSError, EOFError) as exc:  # the worker died (killed for memory?) or could not start
                log.warning("the JSON decoding worker failed (%s); decoding this body in the server", exc)
                self._stop()
                return _decoded(raw, counted)
        if kind == _REFUSED:
            fields = json.loads(payload)
            raise APIError(fields["status"], fields["message"], param=fields["param"], code=fields["code"])
        if kind == _FAILED:  # something else raised there (MemoryError): the server's own decode decides
            return _decoded(raw, counted)
        body: dict[str, Any] = pickle.Unpickler(_SteppedReader(payload)).load()
        return body

    def _ask(self, raw: bytes, counted: Collection[str]) -> tuple[int, bytes]:
        process = self._started()
        assert process.stdin is not None and process.stdout is not None
        names = ",".join(counted).encode("ascii")
        process.stdin.write(_BODY_FRAME.pack(len(raw), len(names)) + names)
        process.stdin.write(raw)
        process.stdin.flush()
        kind, size = _FRAME.unpack(_read_exactly(process.stdout, _FRAME.size))
        return kind, _read_exactly(process.stdout, size)

    def _started(self) -> subprocess.Popen[bytes]:
        if self._closed:
            raise OSError("the server is shutting down")
        if self._process is None or self._process.poll() is not None:
            # -P: not this file's folder on the path (its `errors.py` is the server's, not `swarmkv.api`'s).
            self._process = subprocess.Popen(
                [sys.executable, "-P", str(Path(__file__))], stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
        return self._process

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()  # its stdin's end: the worker's read ends, and it exits
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def close(self) -> None:
        """Stop the worker; later bodies are decoded in the server."""
        with self._lock:
            self._closed = True
            self._stop()

    @property
    def pid(self) -> int | None:
        """The worker's process id, while it runs."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None


def _decoded(raw: bytes, counted: Collection[str]) -> dict[str, Any]:
    """What the worker computes, computed here."""
    body = parse_json_body(raw)
    check_array_counts(body, counted)
    return body


def _read_exactly(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise EOFError(f"the worker's answer ended after {len(data)} of {size} bytes")
    return data


class _SteppedReader(io.RawIOBase):
    """A pickle's bytes, read back through Python calls: the unpickler calls `read` once a frame or slice, and
    between two calls another thread may take the GIL."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._view = memoryview(data)
        self._pos = 0

    def read(self, size: int = -1) -> bytes:
        end = len(self._view) if size < 0 else self._pos + size
        chunk = self._view[self._pos : end].tobytes()
        self._pos += len(chunk)
        return chunk

    def readinto(self, buffer: Any) -> int:
        chunk = self._view[self._pos : self._pos + len(buffer)]
        buffer[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def readline(self, size: int | None = -1) -> bytes:
        end = self._data.find(b"\n", self._pos) + 1 or len(self._data)
        return self.read(end - self._pos)


class _Slices:
    """A long string, pickled as the join of its slices."""

    def __init__(self, text: str) -> None:
        self.slices = [text[i : i + SLICE_CHARS] for i in range(0, len(text), SLICE_CHARS)]

    def __reduce__(self) -> tuple[Any, tuple[list[str]]]:
        return "".join, (self.slices,)


def sliced(body: Any) -> Any:
    """`body` (decoded JSON) with each string, key or value, longer than `SLICE_CHARS` made a `_Slices`, in
    place; iterative, as a body may nest as deeply as the decoder allowed. A container's values are looked at
    by C loops (`map`), so millions of short values cost little more than the decode did."""
    stack = [body]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if max(map(len, node), default=0) > SLICE_CHARS:
                items = list(node.items())
                node.clear()
                node.update((_Slices(k) if len(k) > SLICE_CHARS else k, v) for k, v in items)
            values: list[Any] = list(node.values())
        else:
            values = node
        kinds = set(map(type, values))  # a decoded value's type is exactly dict, list, str, int, ...
        if str in kinds:
            strings = values if len(kinds) == 1 else [v for v in values if type(v) is str]
            if max(map(len, strings)) > SLICE_CHARS:
                slots = node.keys() if isinstance(node, dict) else range(len(node))
                for slot, value in zip(list(slots), values, strict=True):
                    if type(value) is str and len(value) > SLICE_CHARS:
                        node[slot] = _Slices(value)
        if dict in kinds or list in kinds:
            stack.extend(v for v in values if type(v) is dict or type(v) is list)
    return body


def serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """The worker's side: decode each body framed on `stdin`, answer on `stdout`, until `stdin` closes."""
    # Pickling recurses once or twice a level, where the decoder recursed once: room for what it accepted.
    pickle_recursion = 4 * sys.getrecursionlimit()
    while header := stdin.read(_BODY_FRAME.size):
        size, names_size = _BODY_FRAME.unpack(header)
        names = _read_exactly(stdin, names_size).decode("ascii")
        counted = names.split(",") if names else []
        kind, payload = _answer(_read_exactly(stdin, size), counted, pickle_recursion)
        stdout.write(_FRAME.pack(kind, len(payload)))
        stdout.write(payload)
        stdout.flush()


def _pickled(body: Any) -> bytes:
    """`body` pickled without a memo: decoded JSON is a tree, and an unpickler's memo of millions of values
    would be freed in one C call at the end of its load."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=5)
    pickler.fast = True  # no memo (deprecated, but the C pickler's one switch for it)
    pickler.dump(body)
    return out.getvalue()


def _answer(raw: bytes, counted: list[str], pickle_recursion: int) -> tuple[int, bytes]:
    """What the worker answers a body: the object pickled, the 400's fields, or that something else failed."""
    try:
        body = _decoded(raw, counted)
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(pickle_recursion)
        try:
            return _BODY, _pickled(sliced(body))
        finally:
            sys.setrecursionlimit(limit)
    except APIError as exc:
        fields = {"status": exc.status, "message": exc.message, "param": exc.param, "code": exc.code}
        return _REFUSED, json.dumps(fields).encode()
    except Exception:  # the server decodes it itself, and its own error handling answers
        return _FAILED, b""


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
