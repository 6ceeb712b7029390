"""``python -m asyncpp_ext.train``: the ``asyncpp-train`` command (implemented in ``training.cli``)."""
from .training.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
