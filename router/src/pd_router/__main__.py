from pd_router.cli import main

raise SystemExit(main())
