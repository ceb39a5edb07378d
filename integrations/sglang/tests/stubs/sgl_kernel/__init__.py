"""Import-only stand-in for sgl_kernel (test tooling; see ../_importonly.py)."""

import _importonly

__version__ = "0.0.0+importonly"
_importonly.install(__import__(__name__))
