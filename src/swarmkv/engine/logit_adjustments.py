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
from swarmkv.core.sequence import Sequence
from swarmkv.engine.sampler import to_device
from swarmkv.errors import InvalidRequestError


class LogitAdjustments(RequestProcessor):
    """Each request's logit bias and penalties, over logits `vocab_size` wide."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # Penalised requests -> their prompt's distinct ids (sorted, on the host), where a repetition penalty
        # reads them.
        self._penalised: dict[str, torch.Tensor | None] = {}
        # Biased requests -> their bias as (token ids, values) on the host, built once.
        self._biases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def added(self, seq: Sequence) -> None:
        """Refuse a bias on an id past the logits; keep a repetition penalty's prompt ids."""
        params = seq.params
        if params.logit_bias and params.logit_bias[-1][0] >= self.vocab_size:
            raise InvalidRequestError(
                f"logit_bias names token id {params.logit_bias[-1][0]}, outside this model's vocabulary "
                f"(ids 0 to {self.vocab_size - 1})"
            )
        if params.logit_bias:
            tokens, values = zip(*params.logit_bias, strict=True)
            self._biases[seq.request_id] = (
                torch.tensor(tokens, dtype=torch.int64),
                torch.tensor(values, dtype=torch.float64),
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
        """Its prompt ids and bias go."""
        self._penalised.pop(request_id, None)
        self._biases.pop(request_id, None)

    def _bias(self, rows: LogitRows) -> None:
        """Every row's logit bias, added in one op: each biased chunk's bias repeated over its rows."""
        at: list[torch.Tensor] = []
        tokens: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for first, chunk in zip(rows.first_rows(), rows.chunks, strict=True):
            bias = self._biases.get(chunk.request_id)
            if bias is None:
                continue
            n = chunk.num_logits
            at.append(torch.arange(first, first + n).repeat_interleave(len(bias[0])))
            tokens.append(bias[0].repeat(n))
            values.append(bias[1].repeat(n))
        if at:
            logits = rows.logits
            index = to_device(torch.stack([torch.cat(at), torch.cat(tokens)]), logits.device)
            bias_values = to_device(torch.cat(values).to(logits.dtype), logits.device)
            logits.index_put_((index[0], index[1]), bias_values, accumulate=True)

    def _penalise(self, rows: LogitRows) -> None:
        """The penalised rows' penalties, on the tokens each has seen only (a few thousand entries, not rows x
        vocabulary): gathered, changed and written back in one op each."""
        at: list[torch.Tensor] = []
        seen: list[torch.Tensor] = []
        counts: list[torch.Tensor] = []
        settings: list[torch.Tensor] = []
        for first, chunk in zip(rows.first_rows(), rows.chunks, strict=True):
            if chunk.request_id not in self._penalised:
                continue
            params = chunk.seq.params
            prompt = self._penalised[chunk.request_id]
            reply = chunk.seq.output_token_ids + list(chunk.draft)
            num_output = len(chunk.seq.output_token_ids)
            setting = torch.tensor(
                [params.repetition_penalty, params.frequency_penalty, params.presence_penalty],
                dtype=torch.float64,
            )
            for i in range(chunk.num_logits):
                tokens, in_reply = _seen(prompt, torch.tensor(reply[: num_output + i], dtype=torch.int64))
                at.append(torch.full_like(tokens, first + i))
                seen.append(tokens)
                counts.append(in_reply)
                settings.append(setting.expand(len(tokens), 3))
        if not at:
            return
        logits = rows.logits
        device = logits.device
        index = to_device(torch.stack([torch.cat(at), torch.cat(seen), torch.cat(counts)]), device)
        per_entry = to_device(torch.cat(settings).to(logits.dtype), device)
        rows_at, tokens, count = index.unbind(0)
        repetition, frequency, presence = per_entry.unbind(1)
        x = logits[rows_at, tokens]
        x = torch.where(x > 0, x / repetition, x * repetition)
        count = count.to(x.dtype)
        x = x - frequency * count - presence * (count > 0).to(x.dtype)
        logits[rows_at, tokens] = x


def _seen(prompt: torch.Tensor | None, reply: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct ids of a row's prompt (where a repetition penalty reads it: `prompt`, sorted and distinct
    already) and reply, each once, and how often each is in the reply; no sort over the prompt."""
    tokens, counts = torch.unique(reply, return_counts=True)
    if prompt is None or not len(prompt):
        return tokens, counts
    at = torch.searchsorted(prompt, tokens).clamp_(max=len(prompt) - 1)
    in_prompt = prompt[at] == tokens
    prompt_counts = torch.zeros_like(prompt)
    prompt_counts[at[in_prompt]] = counts[in_prompt]
    return torch.cat([prompt, tokens[~in_prompt]]), torch.cat([prompt_counts, counts[~in_prompt]])
