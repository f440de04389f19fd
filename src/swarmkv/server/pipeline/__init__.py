"""The generation pipeline every generation route shares: submit a rendered prompt, stream or collect its outputs."""
