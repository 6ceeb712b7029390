from .info import main

raise SystemExit(main())
