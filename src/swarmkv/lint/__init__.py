"""`swarmkv lint`: find where a request log's prompts stop sharing their prefix, why, and what a fix saves."""
