"""Serving-stack integrations (installed as `kvpush.platforms`)."""
