"""Why a prompt stopped sharing its prefix: the divergence of two rendered prompts and its cause, for the
server's live cache-break counts and for `swarmkv lint` alike."""
