"""``python -m asyncpp_ext.export``: the ``asyncpp-export`` command (implemented in
``training.export``, imported by ``commands.export`` so that a stop request during the imports
ends with one line)."""
from .commands import export as main

if __name__ == "__main__":
    raise SystemExit(main())
