"""The protocol layer, without HTTP: each protocol's request parsers and answer objects, and the one renderer.

Chat completions (`chat_request.py`), completions (`completion_request.py`; both answer with
`completions_objects.py`), Anthropic Messages (`messages_request.py` + `messages_blocks.py`, answered by
`messages_objects.py`), OpenAI Responses (`responses_request.py`, answered by `responses_objects.py` and
`responses_stream.py`) and pins (`pin_request.py`, `pin_objects.py`) share the error and field checks
(`errors.py`, which also refuses a body holding invalid text, a lone surrogate, once as it is decoded), the generation fields (`options.py`), session ids (`session_id.py`), route paths
(`paths.py`), the engine's per-step output (`outputs.py`), the tool-call parser (`tool_parser.py`,
`tool_call_stream.py` for Hermes JSON, `xml_call_stream.py` for Qwen3.5's XML, the format chosen from the
chat template in `tool_formats.py`), the `<think>` reasoning split (`reasoning.py`) and the renderer
(`render.py`: request -> prompt token ids). The server, lint and the cluster import this package; it imports
no web framework.
"""
