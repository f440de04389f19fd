"""Typed errors: every failure a user can cause or fix has its own class."""


class SwarmkvError(Exception):
    """Base class of every error swarmkv raises on purpose."""


class ModelLoadError(SwarmkvError):
    """The model path is missing, holds no weights, or the weights are damaged."""


class UnsupportedModelError(SwarmkvError):
    """The checkpoint is readable but describes a model swarmkv cannot run correctly."""


class InvalidRequestError(SwarmkvError, ValueError):
    """A request (prompt, sampling parameters, messages) is malformed or cannot fit."""


class CapacityError(SwarmkvError):
    """The configured KV pool cannot hold what was asked of it."""


class ConfigError(SwarmkvError, ValueError):
    """An engine option cannot be honoured on this machine (a backend it lacks, a device it cannot use)."""


class PinLimitError(InvalidRequestError):
    """A pin would hold more KV than the configured cap on pinned memory."""
