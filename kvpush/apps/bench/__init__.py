"""Engine-emulator benchmark: push (kvpush) vs pull (vLLM NixlConnector model) over real NIXL.

See docs/bench.md for what is modelled, where each step comes from, and the measured results.
"""
