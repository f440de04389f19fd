"""Speculative decoding's drafting side, without a model or tensors: suffix automata over the swarm's text."""

from swarmkv.spec.drafter import Draft, Drafter, DraftSource, Proposer

__all__ = ["Draft", "DraftSource", "Drafter", "Proposer"]
