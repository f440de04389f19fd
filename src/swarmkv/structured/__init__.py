"""Constrained decoding: grammars from JSON schemas and tool definitions, and the engine's per-request matchers."""
