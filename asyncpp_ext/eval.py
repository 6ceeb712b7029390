"""``python -m asyncpp_ext.eval``: the ``asyncpp-eval`` command (implemented in
``training.evaluation``, imported by ``commands.evaluate`` so that a stop request during the imports
ends with one line)."""
from .commands import evaluate as main

if __name__ == "__main__":
    raise SystemExit(main())
