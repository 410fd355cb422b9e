"""Memory backends: where a rank's KV cache lives and how NIXL registers it."""
