"""``python -m asyncpp_ext.schedule``: the ``asyncpp-schedule`` command."""
from .cli import main

raise SystemExit(main())
