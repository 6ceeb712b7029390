"""``python -m asyncpp_ext.sample``: the ``asyncpp-sample`` command (implemented in
``training.sample``, imported by ``commands.sample`` so that a stop request during the imports
ends with one line)."""
from .commands import sample as main

if __name__ == "__main__":
    raise SystemExit(main())
