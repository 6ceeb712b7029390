"""``python -m asyncpp_ext.compare``: the ``asyncpp-compare`` command (implemented in
``training.compare``, imported by ``commands.compare`` so that a stop request during the imports
ends with one line)."""
from .commands import compare as main

if __name__ == "__main__":
    raise SystemExit(main())
