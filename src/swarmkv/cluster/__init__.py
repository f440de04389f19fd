"""Routing requests across engine replicas: the router's policies over a shadow prefix index per replica
(`routing.py`), a synthetic multi-swarm trace (`trace.py`) and the simulator that replays it through the router
and real KV cache managers (`simulate.py`). Pure Python over `swarmkv.kv`; the Ray Serve deployment builds on it."""
