from kvxferd.worker.serve import main

raise SystemExit(main())
