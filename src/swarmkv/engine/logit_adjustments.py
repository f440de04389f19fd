"""OpenAI's logit bias and vLLM's penalties as a per-request processor: the rows of a request that asks for
them change in place before drafts are verified and tokens picked, so greedy, sampled, verified and grammar-
masked rows all see them (a grammar's -inf stays -inf under each). A step whose requests ask for none costs
one look at each chunk's settings.

As vLLM applies them, in this order: the bias is added; repetition divides a positive logit of a token seen in
the prompt or the reply and multiplies a negative one; frequency subtracts once for each time a token is in the
reply, presence once if it is at all. A speculative chunk's row after draft token i counts the draft's first i
tokens as the reply's, as a decode would have.
"""

from __future__ import annotations

import torch

from swarmkv.core.processors import LogitRows, RequestProcessor
from swarmkv.core.scheduler import Chunk
from swarmkv.core.sequence import Sequence
from swarmkv.engine.sampler import to_device
from swarmkv.errors import InvalidRequestError


class LogitAdjustments(RequestProcessor):
    """Each request's logit bias and penalties, over logits `vocab_size` wide."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # Penalised requests -> their prompt's distinct ids (on the logits' device once used), where a
        # repetition penalty reads them.
        self._penalised: dict[str, torch.Tensor | None] = {}

    def added(self, seq: Sequence) -> None:
        """Refuse a bias on an id past the logits; keep a repetition penalty's prompt ids."""
        params = seq.params
        if params.logit_bias and params.logit_bias[-1][0] >= self.vocab_size:
            raise InvalidRequestError(
                f"logit_bias names token id {params.logit_bias[-1][0]}, outside this model's vocabulary "
                f"(ids 0 to {self.vocab_size - 1})"
            )
        if params.penalised:
            prompt = None
            if params.repetition_penalty != 1:
                prompt = torch.tensor(seq.prompt_token_ids, dtype=torch.int64).unique()
            self._penalised[seq.request_id] = prompt

    def needs_ids(self, request_id: str) -> bool:
        """A penalty follows the reply's last token."""
        return request_id in self._penalised

    def logits(self, rows: LogitRows) -> None:
        """Bias and penalise the rows of the requests that ask for it, in place."""
        if not any(c.seq.params.adjusts_logits for c in rows.chunks):
            return
        with torch.inference_mode():  # the runner's logits are inference tensors
            self._bias(rows)
            self._penalise(rows)

    def ended(self, request_id: str) -> None:
        """Its prompt ids go."""
        self._penalised.pop(request_id, None)

    def _bias(self, rows: LogitRows) -> None:
        """Every row's logit bias, added in one op."""
        at: list[int] = []
        tokens: list[int] = []
        values: list[float] = []
        for first, chunk in zip(rows.first_rows(), rows.chunks, strict=True):
            for token, value in chunk.seq.params.logit_bias:
                for row in range(first, first + chunk.num_logits):
                    at.append(row)
                    tokens.append(token)
                    values.append(value)
        if at:
            logits = rows.logits
            index = to_device(torch.tensor([at, tokens], dtype=torch.int64), logits.device)
            bias = to_device(torch.tensor(values, dtype=logits.dtype), logits.device)
            logits.index_put_((index[0], index[1]), bias, accumulate=True)

    def _penalise(self, rows: LogitRows) -> None:
        """The penalised rows' penalties: counts of each row's reply tokens, one scatter for all of them."""
        at: list[int] = []
        replies: list[torch.Tensor] = []
        prompts: list[torch.Tensor] = []
        settings: list[tuple[float, float, float]] = []
        logits = rows.logits
        device, vocab = logits.device, self.vocab_size
        none = torch.empty(0, dtype=torch.int64, device=device)
        for first, chunk in zip(rows.first_rows(), rows.chunks, strict=True):
            if chunk.request_id not in self._penalised:
                continue
            params = chunk.seq.params
            prompt = self._prompt_ids(chunk, device)
            reply = chunk.seq.output_token_ids + list(chunk.draft)
            num_output = len(chunk.seq.output_token_ids)
            for i in range(chunk.num_logits):
                at.append(first + i)
                replies.append(torch.tensor(reply[: num_output + i], dtype=torch.int64))
                prompts.append(prompt if prompt is not None else none)
                settings.append(
                    (params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
                )
        if not at:
            return
        index = to_device(torch.tensor(at, dtype=torch.int64), device)
        # Ids padded with `vocab`, one column past the logits, cut off after the scatter.
        padded = torch.nn.utils.rnn.pad_sequence(replies, batch_first=True, padding_value=vocab)
        padded = to_device(padded, device)
        counts = torch.zeros(len(at), vocab + 1, dtype=logits.dtype, device=device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=logits.dtype))
        counts = counts[:, :vocab]
        seen = torch.zeros(len(at), vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(
            1, torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True, padding_value=vocab), True
        )
        seen = seen[:, :vocab] | (counts > 0)
        repetition, frequency, presence = (
            to_device(torch.tensor(settings, dtype=logits.dtype), device).unsqueeze(-1).unbind(1)
        )
        x = logits[index]
        scale = torch.where(seen, repetition, torch.ones_like(repetition))
        x = torch.where(x > 0, x / scale, x * scale)
        x -= frequency * counts + presence * (counts > 0).to(x.dtype)
        logits[index] = x

    def _prompt_ids(self, chunk: Chunk, device: torch.device) -> torch.Tensor | None:
        """The request's distinct prompt ids on `device` (moved there once), None without a repetition penalty."""
        prompt = self._penalised[chunk.request_id]
        if prompt is not None and prompt.device != device:
            prompt = self._penalised[chunk.request_id] = prompt.to(device)
        return prompt
