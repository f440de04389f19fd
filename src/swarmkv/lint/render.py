"""Logged request bodies -> the token ids the server computes for them, by the server's own parsers and renderer.

A body is parsed as its route parses it and rendered by `swarmkv.api.render`, the renderer the server runs.
Tokenizing dominates a lint, and a session's turns repeat their history, so a chat prompt is rendered once
per distinct (messages, tools, forced opening), and its text is encoded in pieces split at the special
tokens (the tokenizer splits there first itself, so the ids are the same), each distinct piece once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from swarmkv.api.chat_request import ChatRequest, parse_chat_request
from swarmkv.api.completion_request import parse_completion_request
from swarmkv.api.errors import APIError
from swarmkv.api.layout import Layout, resolve_layout
from swarmkv.api.render import render_completion, render_request
from swarmkv.breaks.causes import RenderedPrompt
from swarmkv.choices import PromptLayout
from swarmkv.errors import InvalidRequestError
from swarmkv.lint.log_file import LoggedRequest
from swarmkv.tokenizer import Tokenizer


class RenderError(InvalidRequestError):
    """A logged request the server would have refused, or the template cannot render."""


@dataclass(frozen=True)
class RenderedRequest:
    """A logged request with its prompt, as the engine would have received it."""

    request: LoggedRequest
    prompt: RenderedPrompt
    cache_salt: str | None
    session_id: str | None  # the log's, else the body's
    user: str | None  # the body's `user` field


class Renderer:
    """Renders logged requests with one tokenizer, caching texts and encoded pieces."""

    def __init__(
        self, tokenizer: Tokenizer, max_model_len: int | None = None, prompt_layout: PromptLayout = "auto"
    ) -> None:
        """`max_model_len`: refuse prompts that leave no room for the reply in it, as the server does;
        `prompt_layout`: the server's `--prompt-layout`, resolved per request by the API it came in on (the log
        holds chat bodies, and names the API of a Messages or Responses request)."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.prompt_layout = prompt_layout
        special = [
            token.content
            for token in tokenizer.backend.get_added_tokens_decoder().values()
            if token.special and not (token.lstrip or token.rstrip or token.single_word or token.normalized)
        ]
        # Longest first, as the tokenizer matches them.
        pattern = "|".join(re.escape(t) for t in sorted(special, key=len, reverse=True))
        self._special = re.compile(f"({pattern})") if special else None
        self._pieces: dict[str, list[int]] = {}
        self._prompts: dict[str, RenderedPrompt] = {}

    def render(self, request: LoggedRequest, layout: Layout | None = None) -> RenderedRequest:
        """The request's prompt (in `layout`, by default the server's); RenderError when the server would
        refuse the body or cannot render it."""
        try:
            if request.is_chat:
                chat = parse_chat_request(request.body).for_template(self.tokenizer.chat_template)
                options = chat.options
                prompt = self._chat(chat, layout or self.layout_of(request))
                stop, param = chat.forced_stop(), "messages"
            else:
                completion = parse_completion_request(request.body)
                options = completion.options
                prompt = self._completion(completion.prompt)
                stop, param = (), "prompt"
            if self.max_model_len is not None:
                options.sampling_params(len(prompt.token_ids), self.max_model_len, param, stop)
        except APIError as exc:
            raise RenderError(exc.message) from exc
        except InvalidRequestError as exc:
            raise RenderError(str(exc)) from exc
        session = request.session_id if request.session_id is not None else options.session_id
        user = request.body.get("user")
        salt = options.cache_salt
        if request.tenant is not None:  # as the server scopes them: tenants share no KV and no session
            salt = request.tenant if salt is None else f"{request.tenant}\0{salt}"
            session = None if session is None else f"{request.tenant}\0{session}"
        return RenderedRequest(request, prompt, salt, session, user if isinstance(user, str) else None)

    def layout_of(self, request: LoggedRequest) -> Layout:
        """The layout the server gave this request: its `--prompt-layout` on the API it came in on."""
        return resolve_layout(self.prompt_layout, request.api)

    def encode(self, text: str) -> list[int]:
        """`tokenizer.encode(text, add_special_tokens=False)`, from cached pieces."""
        if self._special is None:
            return self.tokenizer.encode(text)
        ids: list[int] = []
        for piece in self._special.split(text):
            if not piece:
                continue
            cached = self._pieces.get(piece)
            if cached is None:
                cached = self._pieces[piece] = self.tokenizer.encode(piece)
            ids += cached
        return ids

    def _chat(self, chat: ChatRequest, layout: Layout) -> RenderedPrompt:
        key = json.dumps(
            [layout, chat.messages, chat.prompt_tools, chat.forced_prefix(), chat.template_kwargs],
            sort_keys=True,
            ensure_ascii=False,
        )
        prompt = self._prompts.get(key)
        if prompt is None:
            prompt = self._prompts[key] = render_request(self.tokenizer, chat, layout, self.encode)[1]
        return prompt

    def _completion(self, prompt: str | list[int]) -> RenderedPrompt:
        ids = list(render_completion(self.tokenizer, prompt))
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=False)
        return RenderedPrompt(ids, text, [], None)
