"""The OpenAI-compatible HTTP server: `create_app(llm)` and the `swarmkv serve` command."""

from swarmkv.server.app import create_app

__all__ = ["create_app"]
