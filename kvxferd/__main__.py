from kvxferd.cli import main

raise SystemExit(main())
