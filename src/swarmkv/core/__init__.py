"""The engine core without tensors: scheduler, sequences, sampling settings, pins, counters and typed stats,
driven by `EngineCore` (core.py) over the KV manager; `LLMEngine` and the tools that need the engine's books
without a model (the planner, lint, the cluster router and simulator) all drive it. Imports no torch."""
