"""The engine: sequences, scheduling, model running and the offline LLM API."""
