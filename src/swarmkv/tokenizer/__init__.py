"""Text <-> token ids for the engine: HF and GGUF tokenizers, chat templates, streaming detokenization."""

from swarmkv.tokenizer.chat import ChatTemplate
from swarmkv.tokenizer.detokenize import IncrementalDetokenizer
from swarmkv.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "IncrementalDetokenizer", "Tokenizer"]
