"""`kvpush demo`: two real processes push KV over NIXL and verify every byte (cli.py is the entry)."""
