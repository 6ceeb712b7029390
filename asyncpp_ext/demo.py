"""`make demo`: the main job on the built-in defaults."""
from .info import main

if __name__ == "__main__":
    raise SystemExit(main())
