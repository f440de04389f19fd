"""The HTTP routes, one module per protocol or resource; each parses with `swarmkv.api` and runs on the pipeline."""
