"""The HTTP server: `create_app(llm, ServerConfig(...))` and the `swarmkv serve` command.

`app.py` wires the parts: `routes/` (one module per protocol or resource), `pipeline/` (run a rendered
request on the engine and stream its deltas), `engine_loop/` (the thread owning the engine, its commands and
streams), `http/` (bodies, disconnects, event streams, the API-key gate, error shapes), `observability/`
(metrics, latency, cache breaks and prompt history, the cache tree and page, the request log). Request
parsing, rendering and the answer objects live in `swarmkv.api`.
"""

from swarmkv.server.app import create_app
from swarmkv.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
