"""`python -m kvpush.platforms.vllm.proxy`: the same as `kvpush proxy`."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
