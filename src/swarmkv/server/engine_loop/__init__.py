"""The engine loop: one thread owns the LLMEngine; other threads queue commands and read per-request streams."""
