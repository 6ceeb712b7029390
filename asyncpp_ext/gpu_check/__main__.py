from asyncpp_ext.gpu_check.runner import main

raise SystemExit(main())
