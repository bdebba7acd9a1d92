"""The compiled frame path's fixtures (``support/frames.py``) for the tests of this package."""

from support.frames import chain, chain3, head_path, inner, link, lone_head, native

__all__ = ["chain", "chain3", "head_path", "inner", "link", "lone_head", "native"]
