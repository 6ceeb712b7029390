"""``python -m asyncpp_ext.train``: the ``asyncpp-train`` command (implemented in ``training.cli``,
imported by ``commands.train`` so that a stop request during the imports ends with one line)."""
from .commands import train as main

if __name__ == "__main__":
    raise SystemExit(main())
